"""The parts of a CUDA backend that need neither a model nor a device to be built:
the weight store, the run state, the counters, the linears and the FFN, wired to
one settings object. CUDABackend composes them with its model's attention block;
tests and scripts build them alone, the same way."""
from __future__ import annotations

from .counters import Counters
from .ffn import FFN
from .linears import Linears
from .settings import CudaSettings
from .state import RunState
from .weights import WeightStore


class Parts:
    def __init__(self, settings: CudaSettings, eps: float):
        self.settings = settings                 # the one settings object: every part reads it through get
        self.store = WeightStore(self.get)
        self.state = RunState(lambda: self.store.f16_elems)
        self.counters = Counters(settings.print_launch_counts)
        self.lin = Linears(self.store, self.state, self.counters, self.get)
        self.ffn = FFN(self.lin, self.state, self.counters, self.get, eps)

    def get(self) -> CudaSettings:
        """The settings now (a replaced object is what every part then reads)."""
        return self.settings
