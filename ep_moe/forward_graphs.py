"""CUDA graphs of a layer's small eager forwards without autograd (inference, evaluation) at EP=1.

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

import itertools
import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch.nn.modules import module as nn_module

from ep_moe.experts import GroupedExperts
from ep_moe.grouped_mm_experts import fused_kernels_only
from ep_moe.kernels.ops import debug_enabled

if TYPE_CHECKING:
    from ep_moe.layer import MoELayer, MoEStats

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
    x_in: torch.Tensor
    y_out: torch.Tensor
    stats: "MoEStats"


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

    @staticmethod
    def takes(layer: "MoELayer", x: torch.Tensor) -> bool:
        """Whether this call of ``layer`` may run graphed: a plain CUDA tensor of 1 to
        :data:`MAX_GRAPHED_TOKENS` tokens, autograd off (forward mode too), not compiled or
        captured already, dropless, the grouped experts on the Triton backend, no debug
        checks, and only the layer's own modules with no hooks inside (module docstring)."""
        if torch.is_grad_enabled() or type(x) is not torch.Tensor or not x.is_cuda or not x.dim():
            return False
        tokens = x.numel() // max(1, x.shape[-1])
        return (0 < tokens <= MAX_GRAPHED_TOKENS and layer.config.capacity_factor is None
                and layer.config.backend != "torch" and isinstance(layer.experts, GroupedExperts)
                and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()
                and not _under_a_transform() and not debug_enabled() and _only_own_modules(layer))

    def __call__(self, layer: "MoELayer", x: torch.Tensor, eager: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``eager(x)`` (the layer's forward), through a graph once the shape is common."""
        if not self.enabled:
            return eager(x)
        shape_key = (tuple(x.shape), x.stride(), x.dtype, x.device, torch.is_autocast_enabled("cuda"),
                     torch.get_autocast_dtype("cuda"), torch.is_inference_mode_enabled(), layer.training)
        addresses = tuple(t.data_ptr() for t in _tensors(layer))
        key = shape_key + addresses
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        else:
            seen = self._calls.pop(key, 0) + 1
            if seen <= CAPTURE_AFTER_CALLS:
                _remember(self._calls, key, seen)
                return eager(x)
            graph = self._capture(layer, x, eager, shape_key, addresses)
            if graph is None:
                return eager(x)
            self._graphs[key] = graph
            if len(self._graphs) > MAX_GRAPHS:
                self._wait_for_replays()  # its memory may be in use on another stream
                self._graphs.popitem(last=False)
        current = torch.cuda.current_stream(x.device)
        if self._replayed is not None:  # the graphs' buffers are shared: one replay at a time
            current.wait_event(self._replayed)
        graph.x_in.copy_(x)
        graph.graph.replay()
        stats = graph.stats  # the graph's own tensors, overwritten by its next replay: copied out
        layer.last_stats = replace(stats, aux_loss=stats.aux_loss.clone(), z_loss=stats.z_loss.clone(),
                                   tokens_per_expert=stats.tokens_per_expert.clone(),
                                   num_dropped=stats.num_dropped.clone())
        y = graph.y_out.clone()
        if self._replayed is None:
            self._replayed = torch.cuda.Event()
        self._replayed.record(current)
        return y

    def _capture(self, layer: "MoELayer", x: torch.Tensor, eager: Callable[[torch.Tensor], torch.Tensor],
                 shape_key: tuple, addresses: tuple) -> Optional[_Graph]:
        """A graph of ``eager`` on ``x``'s shape; None (and eager from now on) where the
        layer's tensors moved too often or the capture fails."""
        if self._addresses.get(shape_key, addresses) != addresses:
            _remember(self._recaptures, shape_key, self._recaptures.get(shape_key, 0) + 1)
            if self._recaptures[shape_key] > MAX_RECAPTURES:
                self._disable(f"its tensors moved {self._recaptures[shape_key]} times between forwards of one shape "
                              "(as FSDP's or ZeRO-3's parameters do)")
                return None
        load = layer._load_since_update
        saved_load = None if load is None else load.clone()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        try:
            graph = _capture(layer, x, eager, self._pool)
        except (ValueError, TypeError):  # the input's own errors, from the eager warm-up: the caller's to see
            raise
        except Exception as error:  # noqa: BLE001 - whatever the capture hit, the layer still runs eagerly
            self._disable(f"capturing a CUDA graph of a forward without autograd failed ({error!r})")
            return None
        finally:
            if load is not None:  # the capture's forwards are not calls: their token counts undone
                load.copy_(saved_load)
        _remember(self._addresses, shape_key, addresses)
        return graph

    def _wait_for_replays(self) -> None:
        if self._replayed is not None:
            self._replayed.synchronize()

    def _disable(self, why: str) -> None:
        warnings.warn(f"MoELayer: {why}; this layer's small forwards without autograd run eagerly from now on",
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


def _tensors(layer: "MoELayer"):
    """Every tensor a layer's forward reads, or writes in place."""
    extra = () if layer._load_since_update is None else (layer._load_since_update,)
    return itertools.chain(layer.parameters(), layer.buffers(), extra)


def _only_own_modules(layer: "MoELayer") -> bool:
    """No global module hook, and below ``layer`` only this library's and torch.nn's modules,
    none with a forward hook: what a replay would not run."""
    if getattr(nn_module, "_global_forward_hooks", None) or getattr(nn_module, "_global_forward_pre_hooks", None):
        return False
    for name, submodule in layer.named_modules():
        if name and (submodule._forward_hooks or submodule._forward_pre_hooks
                     or not type(submodule).__module__.startswith(("ep_moe.", "torch.nn."))):
            return False
    return True


def _under_a_transform() -> bool:
    """Forward-mode AD or a functorch transform (vmap, jvp) is active: the input carries more
    than its values."""
    if getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0:
        return True
    current_level = getattr(getattr(torch._C, "_functorch", None), "maybe_current_level", None)
    return current_level is not None and current_level() is not None


def _capture(layer: "MoELayer", x: torch.Tensor, eager: Callable[[torch.Tensor], torch.Tensor], pool) -> _Graph:
    """One warm-up forward on a side stream, on the fused kernels the capture will run (an
    invalid input raises there), then the capture on that stream into ``pool``. Both without
    autocast's cast cache: a cached cast lives only as long as the caller's autocast region,
    and a graph must cast the weights itself."""
    x_in = x.clone()
    current, stream = torch.cuda.current_stream(x.device), torch.cuda.Stream(x.device)
    stream.wait_stream(current)
    no_cast_cache = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                   enabled=torch.is_autocast_enabled("cuda"), cache_enabled=False)
    with torch.cuda.stream(stream), no_cast_cache:
        with fused_kernels_only():
            eager(x_in)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        # thread-local: CUDA calls of other threads (a data loader's) stay legal meanwhile
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            y_out = eager(x_in)
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return _Graph(graph, x_in, y_out, layer.last_stats)
