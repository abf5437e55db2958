"""The paged KV cache's bookkeeping: blocks, prefixes, sequences; backend-agnostic.

blocks.py: the block pool shared by every sequence (refcounts, the prefix cache and
its eviction); sequence.py: one sequence's block table in that pool. No device
memory here: a backend owns the K/V arrays and reads the slots these hand out.
"""
