"""What this process may still allocate on the host: /proc/meminfo's MemAvailable,
or less where a memory cgroup (a container's limit) leaves less. The CPU backend
asks before it dequantizes weights to float32 and before it allocates a KV cache."""
from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit, usage) files of a memory cgroup: v2, then v1; the process sees its own
# cgroup at the root of the hierarchy inside a container
_CGROUP_FILES = (("memory.max", "memory.current", "memory.stat"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat"))
_NO_LIMIT = 1 << 60          # v1 writes "no limit" as a page-rounded 2^63 - 1


def cgroup_room(root: Path = CGROUP_ROOT) -> int | None:
    """Bytes the memory cgroup still lets this process take: its limit minus what it
    uses that cannot be reclaimed (usage less the inactive file cache, as `docker
    stats` counts it); None without a cgroup or without a limit."""
    for limit_f, usage_f, stat_f in _CGROUP_FILES:
        try:
            limit = (root / limit_f).read_text().strip()
            usage = int((root / usage_f).read_text())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= _NO_LIMIT:
            return None
        inactive = 0
        try:
            for line in (root / stat_f).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k in ("inactive_file", "total_inactive_file"):
                    inactive = max(inactive, int(v))
        except (OSError, ValueError):
            pass
        return max(0, int(limit) - max(0, usage - inactive))
    return None


def meminfo_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the file does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes() -> int | None:
    """What this process may still allocate: MemAvailable of /proc/meminfo, or less
    where a memory cgroup (a container's limit) leaves less; None where neither says."""
    have = meminfo_available()
    room = cgroup_room()
    return room if have is None else have if room is None else min(have, room)
