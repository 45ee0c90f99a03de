"""CUDA graphs of a layer's small eager forwards without autograd (inference, evaluation) at EP=1.

Such a forward is host-bound: its ~35 torch ops cost the host more than the GPU takes to run
them. Without autograd, dropless and with no EP group it has no host sync and its shapes
depend on the token count alone, so :class:`ForwardGraphs` captures it on the third call of
an input shape (:data:`CAPTURE_AFTER_CALLS` eager calls first, so that one-off shapes, as a
prefill of each prompt's length, stay eager) and replays it from then on: the host copies the
input in, replays, and clones the output and the stats out, a few launches instead of ~35.
The graph runs the fused kernels (as a capture does, :mod:`ep_moe.grouped_mm_experts`).

A graph holds the addresses of what it reads: the key of a graph includes the layer's
parameters and buffers' addresses, so moving or replacing them captures anew. A layer whose
tensors keep moving between calls (FSDP's unsharded parameters, ZeRO-3's gathered ones) stops
capturing after :data:`MAX_RECAPTURES` recaptures of one shape and runs eagerly from then on.
At most :data:`MAX_GRAPHS` graphs per layer, the least recently used dropped first.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch

from ep_moe.experts import GroupedExperts
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
"""Recaptures of one input shape (its tensors moved) after which the layer stays eager."""


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    x_in: torch.Tensor
    y_out: torch.Tensor
    stats: "MoEStats"


class ForwardGraphs:
    """A layer's captured forwards, by input shape and everything else the capture fixed."""

    def __init__(self) -> None:
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._calls: dict[tuple, int] = {}
        self._captures: dict[tuple, int] = {}
        self.enabled = True
        """False after a shape recaptured too often (see the module docstring); settable."""

    @staticmethod
    def takes(layer: "MoELayer", x: torch.Tensor) -> bool:
        """Whether this call of ``layer`` may run graphed: a CUDA input of 1 to
        :data:`MAX_GRAPHED_TOKENS` tokens, autograd off, not compiled or captured already,
        dropless, the grouped experts on the Triton backend, no debug checks."""
        if torch.is_grad_enabled() or not x.is_cuda or not x.dim():
            return False
        tokens = x.numel() // max(1, x.shape[-1])
        return (0 < tokens <= MAX_GRAPHED_TOKENS and layer.config.capacity_factor is None
                and layer.config.backend != "torch" and isinstance(layer.experts, GroupedExperts)
                and not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()
                and not debug_enabled())

    def __call__(self, layer: "MoELayer", x: torch.Tensor, eager: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``eager(x)`` (the layer's forward), through a graph once the shape is common."""
        if not self.enabled:
            return eager(x)
        shape_key = (tuple(x.shape), x.stride(), x.dtype, x.device, torch.is_autocast_enabled("cuda"),
                     torch.get_autocast_dtype("cuda"), torch.is_inference_mode_enabled(), layer.training)
        key = shape_key + tuple(t.data_ptr() for t in _tensors(layer))
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
        else:
            seen = self._calls.pop(key, 0) + 1
            if seen <= CAPTURE_AFTER_CALLS:
                if len(self._calls) >= 4 * MAX_GRAPHS:  # a bounded memory of the shapes seen
                    self._calls.pop(next(iter(self._calls)))
                self._calls[key] = seen
                return eager(x)
            if self._captures.get(shape_key, 0) > MAX_RECAPTURES:
                self._disable()
                return eager(x)
            load = layer._load_since_update
            saved_load = None if load is None else load.clone()
            graph = _capture(layer, x, eager)
            if load is not None:  # the capture's forwards are not calls: their token counts undone
                load.copy_(saved_load)
            if graph is None:
                self._disable()
                return eager(x)
            self._captures[shape_key] = self._captures.get(shape_key, 0) + 1
            self._graphs[key] = graph
            if len(self._graphs) > MAX_GRAPHS:
                self._graphs.popitem(last=False)
        graph.x_in.copy_(x)
        graph.graph.replay()
        stats = graph.stats  # the graph's own tensors, overwritten by its next replay: copied out
        layer.last_stats = dataclasses.replace(
            stats, aux_loss=stats.aux_loss.clone(), z_loss=stats.z_loss.clone(),
            tokens_per_expert=stats.tokens_per_expert.clone(), num_dropped=stats.num_dropped.clone())
        return graph.y_out.clone()

    def _disable(self) -> None:
        self.enabled = False
        self._graphs.clear()
        self._calls.clear()

    def __deepcopy__(self, memo) -> "ForwardGraphs":
        return ForwardGraphs()  # graphs hold the original's addresses: a copy captures its own

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()


def _tensors(layer: "MoELayer"):
    """Every tensor a layer's forward reads, or writes in place."""
    extra = () if layer._load_since_update is None else (layer._load_since_update,)
    return itertools.chain(layer.parameters(), layer.buffers(), extra)


def _capture(layer: "MoELayer", x: torch.Tensor,
             eager: Callable[[torch.Tensor], torch.Tensor]) -> Optional[_Graph]:
    """One warm-up forward on a side stream (an invalid input raises there), then the capture
    on that stream. None, with a warning, where the capture fails."""
    x_in = x.clone()
    current, stream = torch.cuda.current_stream(x.device), torch.cuda.Stream(x.device)
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        eager(x_in)
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            graph.capture_begin(capture_error_mode="thread_local")  # other threads may use CUDA meanwhile
            try:
                y_out = eager(x_in)
            finally:
                graph.capture_end()
        except RuntimeError as error:
            warnings.warn(f"MoELayer: capturing a CUDA graph of a forward without autograd failed ({error}); "
                          "this layer's forwards run eagerly from now on", stacklevel=4)
            return None
    current.wait_stream(stream)
    return _Graph(graph, x_in, y_out, layer.last_stats)
