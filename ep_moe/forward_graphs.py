"""CUDA graphs of a layer's small eager forwards without autograd (inference, evaluation) at EP=1:
an :class:`ep_moe.MoELayer`'s, and a Hugging Face experts module's under ``"ep_moe"``
(:mod:`ep_moe.integrations.transformers`). The owner of the graphs says what its forward
reads and what else a call hands out (:class:`GraphedForward`).

Such a forward is host-bound: its ~35 torch ops cost the host more than the GPU takes to run
them. Without autograd, dropless and with no EP group it has no host sync and its shapes
depend on the token count alone, so :class:`ForwardGraphs` captures it on the third call of
an input shape (:data:`CAPTURE_AFTER_CALLS` eager calls first, so that one-off shapes, as a
prefill of each prompt's length, stay eager) and replays it from then on: the host copies the
input in, replays, and clones the output and the stats out, a few launches instead of ~35.
The graph runs the fused kernels, as any capture does (:mod:`ep_moe.grouped_mm_experts`), so
from the third call of a shape on the output may differ from the first two's in the last bits.

A graph holds the addresses of what it reads: the key of a graph includes the layer's
parameters' and buffers' addresses, so moving or replacing them captures anew. A layer whose
tensors keep moving (FSDP's unsharded parameters, say) stops capturing after
:data:`MAX_RECAPTURES` recaptures of one shape at new addresses and runs eagerly from then on,
as does one whose capture fails (both with a warning). Only the layer's own code is captured:
a forward hook on one of its submodules, a global module hook, or a submodule of another
library (an adapter, ZeRO-3's gathering) keeps the forward eager, since a replay would skip
them. At most :data:`MAX_GRAPHS` graphs per layer, the least recently used dropped first; all
of a layer's graphs share one memory pool, and its replays run one after another, whatever
stream each call comes on.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Optional, Protocol, Union

import torch
from torch.nn.modules import module as nn_module

from ep_moe.grouped_mm_experts import fused_kernels_only
from ep_moe.kernels.ops import debug_enabled

Inputs = Union[torch.Tensor, tuple[torch.Tensor, ...]]
"""A graphed forward's input: one tensor, or several (copied in, each, before a replay)."""


class GraphedForward(Protocol):
    """What owns a :class:`ForwardGraphs`: the forward it graphs is the owner's."""

    training: bool
    """Part of a graph's key (a capture fixes the forward's behaviour in that mode)."""

    def graphed_tensors(self) -> Iterable[torch.Tensor]:
        """Every tensor the forward reads, or writes in place (their addresses key a graph)."""

    def uncounted(self) -> ContextManager:
        """Around a capture: the capture's forwards leave the owner's state as it was."""

    def call_outputs(self) -> Any:
        """What the last forward handed out besides its result (a graph keeps the capture's),
        or None."""

    def take_replayed(self, outputs: Any) -> None:
        """After a replay: copies of the graph's :meth:`call_outputs`, as a forward hands them out."""

MAX_GRAPHED_TOKENS = 256
"""Most tokens a graphed forward takes (up to there, on an H200 with qwen3-30b-a3b's experts,
the eager forward's host time is about twice the GPU's); larger forwards run eagerly."""
CAPTURE_AFTER_CALLS = 2
"""Eager calls of one input shape before its graph is captured (the next call captures)."""
MAX_GRAPHS = 8
"""Graphs kept per layer, least recently used dropped first."""
MAX_RECAPTURES = 2
"""Recaptures of one input shape at new tensor addresses after which the layer stays eager."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x_in: tuple[torch.Tensor, ...]
    y_out: torch.Tensor
    outputs: Any
    """The owner's :meth:`GraphedForward.call_outputs` of the captured forward."""


def graphable(x: torch.Tensor) -> bool:
    """The conditions every graphed forward shares, on its main input ``x`` [..., H]: a
    plain CUDA tensor of 1 to :data:`MAX_GRAPHED_TOKENS` tokens, autograd off (forward
    mode too), not compiled or captured already, no debug checks."""
    if torch.is_grad_enabled() or type(x) is not torch.Tensor or not x.is_cuda or not x.dim():
        return False
    tokens = x.numel() // max(1, x.shape[-1])
    return (0 < tokens <= MAX_GRAPHED_TOKENS and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing() and not _under_a_transform() and not debug_enabled())


class ForwardGraphs:
    """A layer's captured forwards, by input shape and everything else the capture fixed."""

    def __init__(self, enabled: bool = True) -> None:
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._calls: dict[tuple, int] = {}
        self._addresses: dict[tuple, tuple] = {}
        """Per shape key, the tensor addresses of its last capture."""
        self._recaptures: dict[tuple, int] = {}
        self._pool = None
        self._replayed: Optional[torch.cuda.Event] = None
        self.enabled = enabled
        """Set False to run every forward eagerly (also set after too many recaptures)."""

    def __call__(self, owner: GraphedForward, x: Inputs, eager: Callable[..., torch.Tensor]) -> torch.Tensor:
        """``eager(*x)`` (the owner's forward), through a graph once the shape is common."""
        xs = x if isinstance(x, tuple) else (x,)
        if not self.enabled:
            return eager(*xs)
        device = xs[0].device
        shape_key = (tuple((tuple(t.shape), t.stride(), t.dtype, t.device) for t in xs),
                     torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                     torch.is_inference_mode_enabled(), owner.training)
        addresses = tuple(t.data_ptr() for t in owner.graphed_tensors())
        key = shape_key + addresses
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        else:
            seen = self._calls.pop(key, 0) + 1
            if seen <= CAPTURE_AFTER_CALLS:
                _remember(self._calls, key, seen)
                return eager(*xs)
            graph = self._capture(owner, xs, eager, shape_key, addresses)
            if graph is None:
                return eager(*xs)
            self._graphs[key] = graph
            if len(self._graphs) > MAX_GRAPHS:
                self._wait_for_replays()  # its memory may be in use on another stream
                self._graphs.popitem(last=False)
        current = torch.cuda.current_stream(device)
        if self._replayed is not None:  # the graphs' buffers are shared: one replay at a time
            current.wait_event(self._replayed)
        for x_in, t in zip(graph.x_in, xs):
            x_in.copy_(t)
        graph.graph.replay()
        owner.take_replayed(graph.outputs)  # the graph's own tensors, overwritten by its next replay
        y = graph.y_out.clone()
        if self._replayed is None:
            self._replayed = torch.cuda.Event()
        self._replayed.record(current)
        return y

    def _capture(self, owner: GraphedForward, xs: tuple[torch.Tensor, ...], eager: Callable[..., torch.Tensor],
                 shape_key: tuple, addresses: tuple) -> Optional[_Graph]:
        """A graph of ``eager`` on the inputs' shapes; None (and eager from now on) where the
        owner's tensors moved too often or the capture fails."""
        if self._addresses.get(shape_key, addresses) != addresses:
            _remember(self._recaptures, shape_key, self._recaptures.get(shape_key, 0) + 1)
            if self._recaptures[shape_key] > MAX_RECAPTURES:
                self._disable(owner, f"its tensors moved {self._recaptures[shape_key]} times between forwards of "
                                     "one shape (as FSDP's or ZeRO-3's parameters do)")
                return None
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            with owner.uncounted():  # the capture's forwards are not calls
                graph = _capture(owner, xs, eager, self._pool)
        except (ValueError, TypeError):  # the input's own errors, from the eager warm-up: the caller's to see
            raise
        except Exception as error:  # noqa: BLE001 - whatever the capture hit, the layer still runs eagerly
            self._disable(owner, f"capturing a CUDA graph of a forward without autograd failed ({error!r})")
            return None
        _remember(self._addresses, shape_key, addresses)
        return graph

    def _wait_for_replays(self) -> None:
        if self._replayed is not None:
            self._replayed.synchronize()

    def _disable(self, owner: GraphedForward, why: str) -> None:
        warnings.warn(f"{type(owner).__name__}: {why}; its small forwards without autograd run eagerly from now on",
                      stacklevel=5)
        self._wait_for_replays()
        self.enabled = False
        self._graphs.clear()
        self._calls.clear()

    def __deepcopy__(self, memo) -> "ForwardGraphs":
        return ForwardGraphs(self.enabled)  # graphs hold the original's addresses: a copy captures its own

    def __getstate__(self) -> dict:
        return {"enabled": self.enabled}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["enabled"])


def _remember(memory: dict, key: tuple, value) -> None:
    """``memory[key] = value``, forgetting the oldest key past ``4 * MAX_GRAPHS``: what is
    remembered per shape stays bounded however many shapes come by."""
    memory.pop(key, None)
    if len(memory) >= 4 * MAX_GRAPHS:
        memory.pop(next(iter(memory)))
    memory[key] = value


def only_own_modules(module: torch.nn.Module, libraries: tuple[str, ...] = ("ep_moe.", "torch.nn.")) -> bool:
    """No global module hook, and below ``module`` only ``libraries``' modules, none with a
    forward hook: what a replay would not run."""
    if getattr(nn_module, "_global_forward_hooks", None) or getattr(nn_module, "_global_forward_pre_hooks", None):
        return False
    for name, submodule in module.named_modules():
        if name and (submodule._forward_hooks or submodule._forward_pre_hooks
                     or not type(submodule).__module__.startswith(libraries)):
            return False
    return True


def _under_a_transform() -> bool:
    """Forward-mode AD or a functorch transform (vmap, jvp) is active: the input carries more
    than its values."""
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return True
    current_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
    return current_level is not None and current_level() is not None


def _capture(owner: GraphedForward, xs: tuple[torch.Tensor, ...], eager: Callable[..., torch.Tensor],
             pool) -> _Graph:
    """One warm-up forward on a side stream, on the fused kernels the capture will run (an
    invalid input raises there), then the capture on that stream into ``pool``. Both without
    autocast's cast cache: a cached cast lives only as long as the caller's autocast region,
    and a graph must cast the weights itself."""
    x_in = tuple(t.clone() for t in xs)
    current, stream = torch.cuda.current_stream(xs[0].device), torch.cuda.Stream(xs[0].device)
    stream.wait_stream(current)
    no_cast_cache = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                   enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
    with torch.cuda.stream(stream), no_cast_cache:
        with fused_kernels_only():
            eager(*x_in)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread-local: CUDA calls of other threads (a data loader's) stay legal meanwhile
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            y_out = eager(*x_in)
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return _Graph(graph, x_in, y_out, owner.call_outputs())
