"""utils.diagrams: the data each figure is drawn from, against outside oracles (a simulation of the
ring on numbers, the real ``ring_all_reduce`` run on threads, PyTorch's own bucket assignment,
hand-computed timelines, the ZeRO paper's Figure 1, the Megatron block run whole, the bubble
formula), and each figure built headless with the artists that data says it has."""

from __future__ import annotations

import queue
import threading
import warnings
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402
from torch import nn  # noqa: E402

from utils import diagrams, models  # noqa: E402
from utils.parallel import collectives, pipeline, tensor_parallel  # noqa: E402

MIB = 1024 * 1024


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _quiet(fn, *args, **kwargs):
    """Call a figure function with every warning an error (a clean notebook run prints nothing red)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = fn(*args, **kwargs)
        fig.canvas.draw()  # text layout, glyphs and mathtext happen here
    return fig


def _gids(fig, prefix=""):
    return [a.get_gid() for ax in fig.axes for a in ax.patches if (a.get_gid() or "").startswith(prefix)]


# ---------------------------------------------------------------------------------------
# 1. The ring all-reduce
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8])
def test_ring_schedule_simulated_on_numbers_gives_the_sum_everywhere(n):
    rng = np.random.default_rng(n)
    length = 3 * n + 2  # chunks of unequal size, as tensor_split makes them
    values = [rng.integers(-1000, 1000, size=length) for _ in range(n)]
    chunks = [[c.copy() for c in np.array_split(v, n)] for v in values]
    for phase, transfers in diagrams.ring_schedule(n):
        sent = {(src, dst, c): chunks[src][c].copy() for src, dst, c in transfers}  # all sends leave first
        for (_, dst, c), data in sent.items():
            chunks[dst][c] = chunks[dst][c] + data if phase == "reduce-scatter" else data
    want = np.sum(values, axis=0)
    for r in range(n):
        np.testing.assert_array_equal(np.concatenate(chunks[r]), want)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_ring_schedule_shape_and_bytes(n):
    steps = diagrams.ring_schedule(n)
    assert [p for p, _ in steps] == ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    for _, transfers in steps:  # every rank sends one chunk to its right neighbour, and receives one
        assert sorted(s for s, _, _ in transfers) == list(range(n))
        assert all(d == (s + 1) % n for s, d, _ in transfers)
        assert sorted(c for _, _, c in transfers) == list(range(n))  # one message per chunk per step
    per_rank = sum(1 for _, tr in steps for s, _, _ in tr if s == 0)
    assert per_rank / n == pytest.approx(collectives.ring_allreduce_bytes(1.0, n))  # 2(N-1) chunks of 1/N


def test_ring_states_after_each_phase():
    n = 4
    states = diagrams.ring_states(n)
    assert len(states) == 2 * (n - 1) + 1
    assert states[0] == [[frozenset({r})] * n for r in range(n)]
    full = frozenset(range(n))
    after_rs = states[n - 1]  # rank r holds the whole sum of chunk (r + 1) % n, as collectives says
    for r in range(n):
        assert [c for c in range(n) if after_rs[r][c] == full] == [(r + 1) % n]
    assert all(cell == full for row in states[-1] for cell in row)


class _ThreadRing:
    """Just enough of torch.distributed for ``collectives.ring_all_reduce`` on threads: each
    thread is a rank, messages go through queues, and every send is logged as (step, src, dst,
    chunk), the chunk found from where the sent view starts in the rank's tensor."""

    isend, irecv = "isend", "irecv"

    def __init__(self, n: int, chunk_bytes: int):
        self.n, self.chunk_bytes = n, chunk_bytes
        self.local = threading.local()
        self.queues = {(s, d): queue.Queue() for s in range(n) for d in range(n)}
        self.log, self.lock = [], threading.Lock()

    def get_world_size(self, group=None):
        return self.n

    def get_rank(self, group=None):
        return self.local.rank

    def P2POp(self, op, tensor, peer, group=None):  # noqa: N802 - torch's name
        return (op, tensor, peer)

    def batch_isend_irecv(self, ops):
        me = self.local.rank
        for op, t, peer in ops:
            if op == "isend":
                with self.lock:
                    self.log.append((self.local.step, me, peer, (t.data_ptr() - self.local.base) // self.chunk_bytes))
                self.queues[(me, peer)].put(t.clone())
        for op, t, peer in ops:
            if op == "irecv":
                t.copy_(self.queues[(peer, me)].get(timeout=30))
        self.local.step += 1
        return [SimpleNamespace(wait=lambda: None)]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_schedule_is_what_collectives_ring_all_reduce_sends(n, monkeypatch):
    per_chunk = 5
    fake = _ThreadRing(n, per_chunk * 8)  # float64
    monkeypatch.setattr(collectives, "dist", fake)
    tensors = [torch.arange(n * per_chunk, dtype=torch.float64) * (r + 1) for r in range(n)]
    want = sum(t.clone() for t in tensors)
    errors = []

    def rank(r):
        fake.local.rank, fake.local.step, fake.local.base = r, 0, tensors[r].data_ptr()
        try:
            collectives.ring_all_reduce(tensors[r])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert all(torch.equal(t, want) for t in tensors), "the real ring, run on threads, must give the sum"
    by_step = [sorted((s, d, c) for k, s, d, c in fake.log if k == step) for step in range(2 * (n - 1))]
    assert by_step == [sorted(tr) for _, tr in diagrams.ring_schedule(n)]
    assert len(fake.log) == n * 2 * (n - 1)


@pytest.mark.parametrize("n", [3, 4])
def test_ring_figure_has_a_panel_per_step_and_an_arrow_per_message(n):
    fig = _quiet(diagrams.ring_allreduce_figure, n)
    assert len(fig.axes) == 2 * n  # 2(n-1) steps and the state after each phase
    arrows = [a for ax in fig.axes for a in ax.patches if isinstance(a, FancyArrowPatch)]
    assert len(arrows) == 2 * (n - 1) * n
    want = sorted(f"ring:{s}->{d}:{c}" for _, tr in diagrams.ring_schedule(n) for s, d, c in tr)
    assert sorted(a.get_gid() for a in arrows) == want
    assert fig._suptitle.get_text() and all(ax.get_title() for ax in fig.axes)


# ---------------------------------------------------------------------------------------
# 2. DDP's buckets and overlap
# ---------------------------------------------------------------------------------------


def test_ddp_buckets_hand_cases():
    sizes = [3 * MIB, 1 * MIB, 2 * MIB, 2 * MIB]  # parameters 0..3 in model.parameters() order
    # backward order 3, 2, 1, 0: 2+2 = 4 >= 3 closes [3, 2]; 1+3 = 4 >= 3 closes [1, 0]
    assert diagrams.ddp_buckets(sizes, 3) == [[3, 2], [1, 0]]
    assert diagrams.ddp_buckets(sizes, 10) == [[3, 2, 1, 0]]  # never reaches the cap: one bucket
    assert diagrams.ddp_buckets(sizes, 2) == [[3], [2], [1, 0]]  # reaching the cap exactly closes it
    assert diagrams.ddp_buckets(sizes, 3, first_bucket_mb=1) == [[3], [2, 1], [0]]
    with pytest.raises(ValueError):
        diagrams.ddp_buckets(sizes, 0)


@pytest.mark.skipif(not hasattr(dist, "_compute_bucket_assignment_by_size"), reason="torch's private helper is gone")
@pytest.mark.parametrize("seed", range(5))
def test_ddp_buckets_match_pytorchs_reducer(seed):
    """DDP's rebuilt buckets come from ``_compute_bucket_assignment_by_size`` over the parameters in
    the order their gradients arrived (reverse order here), with limits [first cap, cap]."""
    g = torch.Generator().manual_seed(seed)
    numels = torch.randint(1, 400_000, (12,), generator=g).tolist()
    tensors = [torch.empty(k) for k in numels]
    sizes = [4 * k for k in numels]
    order = list(reversed(range(len(tensors))))
    for cap, first in ((1.0, None), (2.5, 1.0), (0.3, None), (100.0, None)):
        limits = [int((first or cap) * MIB), int(cap * MIB)]
        theirs, _ = dist._compute_bucket_assignment_by_size(
            [tensors[i] for i in order], limits, [False] * len(order), order
        )
        assert diagrams.ddp_buckets(sizes, cap, first_bucket_mb=first) == [list(b) for b in theirs], (cap, first)


def _three_layers(k=256):
    return nn.Sequential(*[nn.Linear(k, k, bias=False) for _ in range(3)])


def test_ddp_timeline_hand_case():
    """Three equal layers, one bucket each, 1 s of backward per layer, 2 s per all-reduce: the
    buckets are ready at 1, 2, 3 s and all-reduced at [1, 3], [3, 5], [5, 7]; serial at [3, 9]."""
    k, n, batch = 256, 4, 8
    model = _three_layers(k)
    layer_bytes = 4 * k * k
    bw = 2 * (n - 1) / n * layer_bytes / 2.0  # the ring's 2(N-1)/N of the bytes, in 2 s
    tl = diagrams.ddp_timeline(
        model, layer_bytes / MIB, world_size=n, batch_size=batch, flops=4 * batch * k * k, alpha_s=0.0, bandwidth=bw
    )
    assert [(round(l["start"], 9), round(l["end"], 9)) for l in tl["layers"]] == [(0, 1), (1, 2), (2, 3)]
    assert [l["name"] for l in tl["layers"]] == ["2", "1", "0"]  # last layer first
    assert [b["params"] for b in tl["buckets"]] == [[2], [1], [0]]
    assert [b["ready"] for b in tl["buckets"]] == pytest.approx([1, 2, 3])
    assert [(b["start"], b["end"]) for b in tl["buckets"]] == [pytest.approx(x) for x in [(1, 3), (3, 5), (5, 7)]]
    assert [(b["serial_start"], b["serial_end"]) for b in tl["buckets"]] == [
        pytest.approx(x) for x in [(3, 5), (5, 7), (7, 9)]
    ]
    assert (tl["t_backward"], tl["t_overlap"], tl["t_serial"]) == pytest.approx((3, 7, 9))


@pytest.mark.parametrize("cap", [0.5, 1, 4, 8, 25, 1000])
def test_overlap_never_ends_after_serial(cap):
    model = models.mlp(512, 6)
    tl = diagrams.ddp_timeline(model, cap)
    assert tl["t_backward"] <= tl["t_overlap"] <= tl["t_serial"] + 1e-15
    assert tl["t_serial"] == pytest.approx(tl["t_backward"] + sum(b["end"] - b["start"] for b in tl["buckets"]))
    every = sorted(i for b in tl["buckets"] for i in b["params"])
    assert every == list(range(len(list(model.parameters()))))  # each gradient in exactly one bucket
    if len(tl["buckets"]) == 1:  # one bucket is ready only when backward ends: nothing to overlap
        assert tl["t_overlap"] == pytest.approx(tl["t_serial"])
    for a, b in zip(tl["buckets"], tl["buckets"][1:]):  # one communication stream, in order
        assert b["start"] >= a["end"] and b["start"] >= b["ready"]


def test_ddp_figure_draws_the_timeline():
    model = models.mlp(1024, 8)
    fig = _quiet(diagrams.ddp_overlap_figure, model, 8)
    tl = diagrams.ddp_timeline(model, 8)
    assert len(fig.axes) == 2
    serial_ax, ddp_ax = fig.axes
    for ax, key in ((serial_ax, "serial_start"), (ddp_ax, "start")):
        bars = [p for p in ax.patches if p.get_gid() == "allreduce"]
        assert [p.get_x() for p in bars] == pytest.approx([b[key] * 1e6 for b in tl["buckets"]])
        assert sum(p.get_gid() == "compute" for p in ax.patches) == len(tl["layers"]) == 8
    assert len(tl["buckets"]) == 4  # 8 MiB cap over 4 MiB layers: two layers per bucket


# ---------------------------------------------------------------------------------------
# 3. ZeRO stages
# ---------------------------------------------------------------------------------------


def test_zero_segments_reproduce_the_zero_paper_figure_1():
    """Rajbhandari et al. 2019 (arXiv:1910.02054), Figure 1: Psi = 7.5B, N = 64, K = 12."""
    paper = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for stage, gb in paper.items():
        segs = diagrams.zero_segments(7.5e9, 64, stage)
        totals = {round(sum(w for _, _, w in rank) / 1e9, 1) for rank in segs}
        assert totals == {gb}, (stage, totals)


@pytest.mark.parametrize("stage", range(4))
def test_zero_segments_tile_each_sharded_state(stage):
    n, psi = 4, 1000
    segs = diagrams.zero_segments(psi, n, stage)
    full = {"params": (0, 2 * psi), "grads": (2 * psi, 2 * psi), "optimizer": (4 * psi, 12 * psi)}
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    for kind, (start, size) in full.items():
        pieces = sorted((s, w) for rank in segs for k, s, w in rank if k == kind)
        if sharded[kind]:  # the ranks' pieces lie end to end and cover the state once
            assert pieces == [(start + r * size / n, size / n) for r in range(n)]
        else:
            assert pieces == [(start, size)] * n


def test_zero_figure_draws_the_formula():
    n, psi = 4, 7.5e9
    fig = _quiet(diagrams.zero_stages_figure, n, psi)
    assert len(fig.axes) == 4
    for stage, ax in enumerate(fig.axes):
        for r in range(n):
            held = [p for p in ax.patches if (p.get_gid() or "").startswith(f"zero:{stage}:{r}:")]
            assert len(held) == 3
            want = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}[stage]
            assert sum(p.get_width() for p in held) == pytest.approx(want / 1e9)


# ---------------------------------------------------------------------------------------
# 4. The Megatron split
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("width,n", [(8, 2), (16, 4), (12, 3)])
def test_megatron_shards_concatenate_to_the_full_weights(width, n):
    s = diagrams.megatron_shapes(width, n)
    hidden = 4 * width
    assert s["w1"] == (hidden, width) and s["w2"] == (width, hidden)
    assert sum(rk["w1"][0] for rk in s["ranks"]) == hidden and {rk["w1"][1] for rk in s["ranks"]} == {width}
    assert sum(rk["w2"][1] for rk in s["ranks"]) == hidden and {rk["w2"][0] for rk in s["ranks"]} == {width}
    assert all(rk["partial"] == s["x"][:1] + (width,) for rk in s["ranks"])
    assert s["max_error"] < 1e-5  # sum of the partials + b2 = the block run whole
    block = models.mlp(width, 1, expand=4, activation="gelu", seed=0)[0]
    w1 = torch.cat([tensor_parallel.column_shard(block[0], r, n)[0] for r in range(n)], 0)
    w2 = torch.cat([tensor_parallel.row_shard(block[2], r, n) for r in range(n)], 1)
    assert torch.equal(w1, block[0].weight) and torch.equal(w2, block[2].weight)


def test_megatron_figure_draws_the_shards_to_scale():
    width, n = 8, 2
    fig = _quiet(diagrams.megatron_split_figure, width, n)
    ax = fig.axes[0]
    boxes = {p.get_gid(): p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid()}
    hidden = 4 * width
    w1t = [boxes[f"rank:{r}:w1t"] for r in range(n)]  # W1^T shards: d tall, h/N wide
    assert sum(b.get_width() for b in w1t) == hidden and {b.get_height() for b in w1t} == {width}
    w2t = [boxes[f"rank:{r}:w2t"] for r in range(n)]  # W2^T shards: h/N tall, d wide
    assert sum(b.get_height() for b in w2t) == hidden and {b.get_width() for b in w2t} == {width}
    full_w1 = [boxes[f"full:w1t:{r}"] for r in range(n)]  # the shards, side by side, make the whole W1^T
    assert [b.get_x() for b in full_w1] == [full_w1[0].get_x() + r * hidden / n for r in range(n)]
    assert sum(isinstance(p, FancyArrowPatch) for p in ax.patches) == n  # every partial into the all-reduce


# ---------------------------------------------------------------------------------------
# 5. Pipeline schedules
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 8), (4, 2), (8, 16)])
def test_pipeline_cells_bubble_and_memory(p, m):
    for kind in ("gpipe", "1f1b"):
        c = diagrams.pipeline_cells(p, m, kind)
        assert c["slots"] == p * 2 * (m + p - 1)  # every stage: m forwards, m backwards, 2(p-1) idle
        assert c["idle"] == 2 * p * (p - 1)
        assert c["idle"] / c["slots"] == pytest.approx((p - 1) / (m + p - 1))
        assert c["bubble"] == pytest.approx(pipeline.bubble_fraction(p, m))
        if kind == "gpipe":
            assert c["in_flight"] == [m] * p
        else:
            assert max(c["in_flight"]) <= p and c["in_flight"] == [min(p - s, m) for s in range(p)]


def test_pipeline_figure_draws_every_cell():
    p, m = 4, 8
    fig = _quiet(diagrams.pipeline_schedule_figure, p, m)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        gids = [r.get_gid() for r in ax.patches if isinstance(r, Rectangle) and r.get_gid()]
        assert gids.count("idle") == 2 * p * (p - 1)
        assert sorted(g for g in gids if g != "idle") == sorted(
            [f"F{i}" for i in range(m)] * p + [f"B{i}" for i in range(m)] * p
        )
