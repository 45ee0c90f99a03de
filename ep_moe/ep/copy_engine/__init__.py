"""The all-gather dispatch on the GPUs' copy engines, through symmetric memory
(``MoEConfig.dispatch="all_gather_copy_engine"``): :mod:`.workspace` holds each rank's
buffer and flag protocols, :mod:`.gather` the exchange and the dispatcher.

Why: NCCL's collectives run as kernels, which need SMs, and a persistent grouped GEMM holds
every SM until it ends: a collective queued beside it hardly progresses. A ``cudaMemcpy``
between GPU memories over NVLink runs on the copy engines instead, with no SM, so the
transfer of one source's tokens runs while the experts' first GEMM already computes on the
tokens that have landed.

How: every rank of the EP group holds one :class:`SymmetricWorkspace`, a buffer in
symmetric memory that every peer can address, and a stream for its copies. Flags are 32-bit
words at the start of each workspace, written and awaited with CUDA stream memory operations
(``cuStreamWriteValue32`` / ``cuStreamWaitValue32``), which the GPU's front end runs: no SM is
needed anywhere, so nothing waits for a GEMM to give one back (a barrier kernel needs an SM;
with the GEMMs holding them all, one per exchange made the layer several times slower than
NCCL: ``benchmarks/PERFORMANCE_LOG.md``).

The layer's exchanges are captured in CUDA graphs, whose replays cannot count on the host,
so each flag is 0 or 1 and whoever waits for it takes it back:

- *Rows, pulled* (:meth:`CopyEngineGather.dispatch`). In the stager's workspace one *free*
  flag per peer (1: that peer has pulled the rows staged last; 1 at the start): the stager's
  compute stream waits for all of them and clears them before it stages (claims the region).
  In each puller's workspace one *staged* flag per source, which the puller's copy stream
  waits for and clears before it copies; after the copy it sets its free flag in the
  source's workspace. The *landing* flag that the experts' GEMM polls
  (:mod:`ep_moe.kernels.arrival`) is in the rank's own workspace, cleared on the compute
  stream before the pulls are queued and raised to w after the w-th source.
- *Sums, pushed* (the forward's reduce-scatter, :meth:`CopyEngineGather.departing`). Each rank
  has an *inbox* of P-1 slots for the peers' token sums. Before a push the sender's copy
  stream waits for its *inbox-free* flag for that receiver (in the sender's workspace, 1 at
  the start) and clears it; after the copy it raises its *arrived* flag in the receiver's
  workspace. The receiver's compute stream waits for every arrived flag and clears them,
  reads the inbox, and sets its inbox-free flag in every sender's workspace.

Limits: NCCL still carries the expert ids and top-k weights (small, needed at once by the
routing), their gradients, and the backward's reduce-scatter (under the dW GEMMs). The GPUs
must reach each other's memory (NVLink or PCIe peer access); symmetric memory's rendezvous
fails otherwise. The workspace grows, collectively and with a device sync, whenever a layer
call needs more than it holds. A flag wait has no timeout: if a rank dies between two
exchanges, its peers' streams wait for it (NCCL's watchdog does not see these waits), so the
job must be torn down from outside, as after a failed rank in any collective.
"""

from ep_moe.ep.copy_engine.gather import AllGatherCopyEngineDispatcher, CopyEngineGather
from ep_moe.ep.copy_engine.workspace import SymmetricWorkspace, copy_engine_supported

__all__ = ["AllGatherCopyEngineDispatcher", "CopyEngineGather", "SymmetricWorkspace", "copy_engine_supported"]
