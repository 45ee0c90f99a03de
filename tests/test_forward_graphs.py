"""The bookkeeping of :mod:`ep_moe.forward_graphs` on the CPU, with the CUDA graph faked (a
replay reruns the captured forward into the graph's own output and stats): when a shape gets
captured, that replays match the eager forward and hand out copies, the least recently used
graph dropped, recaptures when the layer's tensors move and the stop after too many, a failed
capture, and which calls may be graphed at all. The real capture on a GPU:
tests/gpu/test_layer_cuda.py."""

import copy
import dataclasses
import pickle

import pytest
import torch

import ep_moe.forward_graphs as fg
from ep_moe import MoEConfig, MoELayer

H = 16


def _state(layer):
    """What a capture fixes besides shapes and addresses."""
    return layer.training, torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cuda")


class _ReplayRerunsTheForward:
    """A stand-in for ``torch.cuda.CUDAGraph``: ``replay`` runs the forward again and writes
    into the tensors the capture returned, as a real replay would, after checking that the
    state the capture fixed is still the state (else the key missed a part of it)."""

    def __init__(self, layer, eager, graph):
        self.layer, self.eager, self.graph, self.state = layer, eager, graph, _state(layer)

    def replay(self):
        assert _state(self.layer) == self.state, "a graph replayed in another state than it was captured in"
        y = self.eager(*self.graph.x_in)
        self.graph.y_out.copy_(y)
        for name in ("aux_loss", "z_loss", "tokens_per_expert", "num_dropped"):
            getattr(self.graph.outputs, name).copy_(getattr(self.layer.last_stats, name))


class _NoStream:
    def wait_event(self, event):
        pass


class _NoEvent:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def fake_graph_runtime(monkeypatch, fake_capture) -> None:
    """The forward graphs' capture replaced by ``fake_capture(owner, xs, eager, pool)``, and
    the memory pool, streams and events around it by no-ops (CPU tests of the graphs' logic)."""
    monkeypatch.setattr(fg, "_capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    monkeypatch.setattr(torch.cuda, "Event", _NoEvent)


@pytest.fixture
def captures(monkeypatch):
    """Fakes the capture (and the streams, events and memory pool around it); the list
    records each captured input shape."""
    made = []

    def fake_capture(layer, xs, eager, pool):
        x_in = tuple(t.clone() for t in xs)
        y_out = eager(*x_in).clone()
        stats = layer.call_outputs()
        graph = fg._Graph(None, x_in, y_out, dataclasses.replace(
            stats, aux_loss=stats.aux_loss.clone(), z_loss=stats.z_loss.clone(),
            tokens_per_expert=stats.tokens_per_expert.clone(), num_dropped=stats.num_dropped.clone()))
        graph.graph = _ReplayRerunsTheForward(layer, eager, graph)
        made.append(tuple(xs[0].shape))
        return graph

    fake_graph_runtime(monkeypatch, fake_capture)
    return made


def _layer(**overrides):
    torch.manual_seed(0)
    return MoELayer(MoEConfig(**{**dict(hidden_size=H, intermediate_size=8, num_experts=4, top_k=2), **overrides}))


def _call(layer, x):
    """The layer's forward through its graphs (``MoELayer.takes_graphs`` is False on the CPU)."""
    with torch.no_grad():
        return layer.forward_graphs(layer, x, layer._eager_forward)


def test_a_shape_is_captured_on_its_third_call_and_replays_match_eager(captures):
    layer = _layer()
    gen = torch.Generator().manual_seed(1)
    for call in range(5):
        x = torch.randn(5, H, generator=gen)
        got = _call(layer, x)
        with torch.no_grad():
            want = layer._eager_forward(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert captures == ([] if call < fg.CAPTURE_AFTER_CALLS else [(5, H)])
    _call(layer, x)  # replayed
    stats_before = layer.last_stats
    kept = stats_before.tokens_per_expert.clone()
    while torch.equal(layer.last_stats.tokens_per_expert, kept):  # a call that routes otherwise
        _call(layer, torch.randn(5, H, generator=gen))
    assert torch.equal(stats_before.tokens_per_expert, kept), "stats handed out alias the graph's tensors"
    assert layer.last_stats is not stats_before and not layer.last_stats.with_autograd


def test_the_least_recently_used_graph_is_dropped(captures, monkeypatch):
    monkeypatch.setattr(fg, "MAX_GRAPHS", 2)
    layer = _layer()
    for tokens in (1, 2, 1, 3):  # 1 used after 2: 2 is dropped when 3 comes
        for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
            _call(layer, torch.randn(tokens, H))
    assert [key[0][0][0] for key in layer.forward_graphs._graphs] == [(1, H), (3, H)]
    assert captures == [(1, H), (2, H), (3, H)]


def test_moved_tensors_capture_anew_and_a_layer_whose_tensors_keep_moving_stays_eager(captures):
    layer = _layer()
    x = torch.randn(3, H)
    for move in range(fg.MAX_RECAPTURES + 1):
        for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
            got = _call(layer, x)
        with torch.no_grad():
            torch.testing.assert_close(got, layer._eager_forward(x), rtol=0, atol=0)
        layer.router.weight.data = layer.router.weight.data * 1.5  # new storage, as a reshard leaves
        if move == fg.MAX_RECAPTURES:
            break
    with pytest.warns(UserWarning, match="tensors moved"):
        for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
            got = _call(layer, x)
    with torch.no_grad():
        torch.testing.assert_close(got, layer._eager_forward(x), rtol=0, atol=0)
    assert len(captures) == fg.MAX_RECAPTURES + 1
    assert not layer.forward_graphs.enabled and not layer.forward_graphs._graphs


def test_a_failed_capture_leaves_the_layer_eager(captures, monkeypatch):
    def failing_capture(layer, xs, eager, pool):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(fg, "_capture", failing_capture)
    layer = _layer()
    x = torch.randn(2, H)
    with pytest.warns(UserWarning, match="capturing a CUDA graph .* failed"):
        for _ in range(fg.CAPTURE_AFTER_CALLS + 2):
            got = _call(layer, x)
    with torch.no_grad():
        torch.testing.assert_close(got, layer._eager_forward(x), rtol=0, atol=0)
    assert not layer.forward_graphs.enabled


def test_expert_bias_counts_each_call_once(captures):
    layer = _layer(expert_bias=True)
    x = torch.randn(4, H)
    calls = 6
    for _ in range(calls):
        _call(layer, x)
    with torch.no_grad():
        layer._eager_forward(x)
    assert torch.equal(layer._load_since_update, (calls + 1) * layer.last_stats.tokens_per_expert)


def test_which_calls_may_be_graphed(monkeypatch):
    layer = _layer()
    x = torch.randn(4, H)
    assert not layer.takes_graphs(x)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with torch.no_grad():
        assert layer.takes_graphs(x)
        assert not layer.takes_graphs(torch.randn(fg.MAX_GRAPHED_TOKENS + 1, H))
        assert not _layer(capacity_factor=1.0).takes_graphs(x)
        assert not _layer(backend="torch").takes_graphs(x)
        monkeypatch.setenv("EP_MOE_DEBUG", "1")
        assert not layer.takes_graphs(x)
    assert not layer.takes_graphs(x)  # autograd on


def test_copies_of_a_layer_capture_their_own_and_keep_the_switch(captures):
    layer = _layer()
    for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
        _call(layer, torch.randn(2, H))
    copies = [copy.deepcopy(layer)] + [pickle.loads(pickle.dumps(layer, protocol)) for protocol in (0, 2)]
    for other in copies:
        assert other.forward_graphs is not layer.forward_graphs and not other.forward_graphs._graphs
        assert other.forward_graphs.enabled
        _call(other, torch.randn(2, H))
    layer.forward_graphs.enabled = False
    assert not copy.deepcopy(layer).forward_graphs.enabled
    assert not pickle.loads(pickle.dumps(layer, 0)).forward_graphs.enabled


def test_the_training_flag_and_inference_mode_get_graphs_of_their_own(captures):
    layer = _layer()
    x = torch.randn(3, H)
    for mode in ("train", "eval", "train", "inference", "eval"):
        for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
            if mode == "inference":
                with torch.inference_mode():
                    got = layer.forward_graphs(layer, x, layer._eager_forward)
            else:
                layer.train(mode == "train")
                got = _call(layer, x)
        with torch.no_grad():
            torch.testing.assert_close(got, layer._eager_forward(x), rtol=0, atol=0)
    assert len(captures) == 3


def test_shapes_that_take_turns_past_the_cache_keep_their_graphs_coming(captures, monkeypatch):
    """More shapes in turn than MAX_GRAPHS: each comes back evicted and is captured again at
    the same addresses, which is no reason to stop graphing."""
    monkeypatch.setattr(fg, "MAX_GRAPHS", 2)
    layer = _layer()
    for _ in range(fg.MAX_RECAPTURES + 3):
        for tokens in (1, 2, 3):
            for _ in range(fg.CAPTURE_AFTER_CALLS + 1):
                _call(layer, torch.randn(tokens, H))
    assert layer.forward_graphs.enabled and len(layer.forward_graphs._graphs) == 2


def test_hooks_other_modules_and_tensor_subclasses_keep_the_forward_eager(monkeypatch):
    layer = _layer()
    x = torch.randn(4, H)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with torch.no_grad():
        assert layer.takes_graphs(x)
        handle = layer.experts.register_forward_pre_hook(lambda module, args: None)
        assert not layer.takes_graphs(x), "a replay would skip the experts' hook"
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
        assert not layer.takes_graphs(x), "a replay would skip a global hook"
        handle.remove()
        assert layer.takes_graphs(x)

        class Adapter(torch.nn.Module):  # another library's module inside the layer
            def forward(self, t):
                return t

        layer.router.adapter = Adapter()
        assert not layer.takes_graphs(x)
        del layer.router.adapter

        class Wrapped(torch.Tensor):
            pass

        assert not layer.takes_graphs(x.as_subclass(Wrapped))
        assert layer.takes_graphs(x)


def test_a_bad_input_raises_its_own_error_every_time_and_leaves_graphs_on(captures):
    layer = _layer()  # the capture's warm-up raises the forward's error, as the eager calls did
    for _ in range(fg.CAPTURE_AFTER_CALLS + 2):
        with pytest.raises(ValueError, match="hidden_size"):
            _call(layer, torch.randn(3, H + 1))
    assert layer.forward_graphs.enabled
