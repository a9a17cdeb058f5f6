"""utils.diagrams: the data each figure is drawn from, against outside oracles (a simulation of the
ring on numbers, the real ``ring_all_reduce`` run on threads, PyTorch's own bucket assignment,
hand-computed timelines, the ZeRO paper's Figure 1, the Megatron block run whole, the bubble
formula, gloo's own collectives on threads, ``DistributedSampler``, SLURM's and torchrun's rank
arithmetic, autograd's saved tensors and the measured peak, ``FlopCounterMode``, Amdahl's and
Gustafson's closed forms), and each figure built headless with the artists that data says it has."""

from __future__ import annotations

import queue
import threading
import warnings
from datetime import timedelta
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
from torch.utils.data import DistributedSampler  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from utils import diagrams, memory, models  # noqa: E402
from utils.parallel import collectives, pipeline, shard, tensor_parallel  # noqa: E402

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


# ---------------------------------------------------------------------------------------
# 6. The five collectives
# ---------------------------------------------------------------------------------------


def _gloo_collectives(n: int) -> dict[int, dict[str, list]]:
    """PyTorch's own collectives (gloo), one thread per rank of one process, on the inputs
    ``collective_states`` says each rank starts with."""
    store, out, errors = dist.HashStore(), {}, []
    x = torch.arange(1, n * n + 1, dtype=torch.float32).reshape(n, n)

    def rank(r):
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("diagrams", store), r, n, timedelta(seconds=30))
            res = {}
            t = x[r].clone()
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([t], opts).wait()
            res["broadcast"] = t.tolist()
            t = x[r].clone()
            opts = dist.ReduceOptions()
            opts.rootRank = 0
            pg.reduce([t], opts).wait()
            res["reduce"] = t.tolist()
            t = x[r].clone()
            pg.allreduce([t]).wait()
            res["all_reduce"] = t.tolist()
            parts = [torch.zeros(1) for _ in range(n)]
            pg.allgather([parts], [x[r, r : r + 1].clone()]).wait()
            res["all_gather"] = [p.item() for p in parts]
            mine = torch.zeros(1)
            pg.reduce_scatter([mine], [[x[r, c : c + 1].clone() for c in range(n)]]).wait()
            res["reduce_scatter"] = mine.item()
            out[r] = res
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(out) == n, errors
    return out


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collective_states_are_what_gloo_computes(n):
    states, theirs = diagrams.collective_states(n), _gloo_collectives(n)
    for r in range(n):
        assert states["broadcast"]["after"][r] == theirs[r]["broadcast"]
        assert states["all_reduce"]["after"][r] == theirs[r]["all_reduce"]
        assert states["all_gather"]["after"][r] == theirs[r]["all_gather"]
        assert states["reduce_scatter"]["after"][r] == [
            theirs[r]["reduce_scatter"] if c == r else None for c in range(n)
        ]
    assert states["reduce"]["after"][0] == theirs[0]["reduce"]  # only the root's buffer is defined
    assert all(v is None for r in range(1, n) for v in states["reduce"]["after"][r])


def test_collective_states_by_hand():
    s = diagrams.collective_states(2)  # rank 0 holds [1, 2], rank 1 [3, 4]
    assert s["all_reduce"]["after"] == [[4, 6], [4, 6]]
    assert s["reduce"]["after"] == [[4, 6], [None, None]]
    assert s["broadcast"]["after"] == [[1, 2], [1, 2]]
    assert s["all_gather"]["before"] == [[1, None], [None, 4]] and s["all_gather"]["after"] == [[1, 4], [1, 4]]
    assert s["reduce_scatter"]["after"] == [[4, None], [None, 6]]


def test_collectives_figure_draws_every_held_cell():
    n = 4
    fig = _quiet(diagrams.collectives_figure, n)
    states = diagrams.collective_states(n)
    assert len(fig.axes) == 2 * len(diagrams.COLLECTIVES)
    want = sorted(
        f"{name}:{phase}:{r}:{c}"
        for name, st in states.items()
        for phase, grid in st.items()
        for r, row in enumerate(grid)
        for c, v in enumerate(row)
        if v is not None
    )
    assert sorted(g for g in _gids(fig) if g) == want
    assert all(ax.get_title() for ax in fig.axes)


# ---------------------------------------------------------------------------------------
# 7. Data, tensor and pipeline parallelism
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,depth,width,batch", [(2, 4, 8, 6), (4, 4, 8, 8), (4, 8, 4, 10)])
def test_parallel_split_against_sampler_and_by_hand(n, depth, width, batch):
    split = diagrams.parallel_split(n, depth, width, batch)
    hidden = 4 * width
    for r in range(n):
        sampler = list(DistributedSampler(range(batch), num_replicas=n, rank=r, shuffle=False))
        assert split["data"][r] == {"blocks": list(range(depth)), "hidden": (0, hidden), "rows": sampler}
        per = hidden // n
        assert split["tensor"][r] == {
            "blocks": list(range(depth)),
            "hidden": (r * per, (r + 1) * per),
            "rows": list(range(batch)),
        }
        per_stage = depth // n
        assert split["pipeline"][r]["blocks"] == list(range(r * per_stage, (r + 1) * per_stage))
        assert split["pipeline"][r]["hidden"] == (0, hidden) and split["pipeline"][r]["rows"] == list(range(batch))


def test_parallel_split_figure_fills_what_each_rank_holds():
    n, depth, width, batch = 4, 4, 8, 8
    fig = _quiet(diagrams.parallel_split_figure, n, depth, width, batch)
    split = diagrams.parallel_split(n, depth, width, batch)
    assert len(fig.axes) == 3
    for ax, kind in zip(fig.axes, diagrams.SPLITS):
        patches = {p.get_gid(): p for p in ax.patches if p.get_gid()}
        for r, held in enumerate(split[kind]):
            assert {g for g in patches if g.startswith(f"{kind}:{r}:block:")} == {
                f"{kind}:{r}:block:{b}" for b in held["blocks"]
            }
            assert {g for g in patches if g.startswith(f"{kind}:{r}:row:")} == {
                f"{kind}:{r}:row:{i}" for i in held["rows"]
            }
            lo, hi = held["hidden"]
            height = patches[f"{kind}:{r}:block:{held['blocks'][0]}"].get_height()
            assert height == pytest.approx(0.7 * (hi - lo) / (4 * width))


# ---------------------------------------------------------------------------------------
# 8. Ranks, local ranks and nodes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("nodes,gpus", [(2, 4), (3, 2), (1, 8)])
def test_rank_layout_by_hand(nodes, gpus):
    tasks = diagrams.rank_layout(nodes, gpus, job_id=123456)
    assert len(tasks) == nodes * gpus
    for t in tasks:
        assert t["rank"] == t["node"] * gpus + t["local_rank"]  # torchrun's group_rank x nproc + local_rank
        assert t["host"] == f"node{t['node'] + 1:02d}" and t["gpu"] == t["local_rank"] < gpus
        assert (t["world_size"], t["local_world_size"]) == (nodes * gpus, gpus)
        assert (t["master_addr"], t["master_port"]) == ("node01", 23456)  # 20000 + 123456 % 10000
    assert sorted(t["rank"] for t in tasks) == list(range(nodes * gpus))


def test_rank_layout_figure_has_a_box_per_gpu():
    fig = _quiet(diagrams.rank_layout_figure, 2, 4)
    assert sorted(_gids(fig, "gpu:")) == sorted(f"gpu:{r}" for r in range(8))
    assert sorted(_gids(fig, "node:")) == ["node:0", "node:1"]
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("RANK 5\nLOCAL_RANK 1" in t for t in texts)  # node 1's second GPU
    assert "WORLD_SIZE = 8" in fig.axes[0].get_title()


# ---------------------------------------------------------------------------------------
# 9. Memory over one training step
# ---------------------------------------------------------------------------------------


def test_step_memory_by_hand():
    """Width 2, 2 blocks, batch 1, SGD: a block has 2x8 + 8 + 8x2 + 2 = 42 parameters (168 bytes)
    and saves 9 floats per row per width (72 bytes); the loss keeps the output (8 bytes)."""
    totals = [sum(st.values()) for _, st in diagrams.step_memory(2, 2, 1)]
    assert totals == [336, 408, 480, 488, 480, 648, 576, 744, 672, 672, 336]
    ckpt = diagrams.step_memory(2, 2, 1, segment=1)  # keeps each block's input (8 bytes) instead
    assert [label for label, _ in ckpt][:5] == ["start", "F0", "F1", "loss", "loss'"]
    assert [sum(st.values()) for _, st in ckpt] == [336, 344, 352, 360, 352, 416, 584, 512, 576, 744, 672, 672, 336]


@pytest.mark.parametrize("segment", [None, 2, 4])
def test_step_memory_against_autograd_and_the_measured_peak(segment):
    """After forward the activations held are what autograd saved (counted by hooks), and the
    timeline's peak is the measured peak of a real step, less the temporaries backward makes."""
    w, depth, batch = 64, 8, 256
    ev = diagrams.step_memory(w, depth, batch, segment=segment)
    fwd = memory.activation_checkpointed_forward(segment)
    x = torch.randn(batch, w)
    saved = memory.saved_bytes(memory.block_mlp(w, depth), x, forward=lambda m, inp: fwd(m, inp).pow(2).mean())
    assert dict(ev)["loss"]["activations"] == saved
    assert ev[0][1] == ev[-1][1] and ev[-1][1]["grads"] == 0  # the step ends where it started
    assert min(st["activations"] for _, st in ev) == 0
    measured = memory.measure_step(w, depth, batch, "sgd", forward=fwd, steps=1)["peak"]
    assert 1.0 <= measured / max(sum(st.values()) for _, st in ev) < 1.25


def test_step_memory_figure_peaks():
    fig = _quiet(diagrams.step_memory_figure, 64, 8, 256, segment=2)
    assert len(fig.axes) == 2
    for ax, seg in zip(fig.axes, (None, 2)):
        peak = max(sum(st.values()) for _, st in diagrams.step_memory(64, 8, 256, segment=seg))
        (line,) = [ln for ln in ax.lines if ln.get_gid() == "peak"]
        assert line.get_ydata()[0] == pytest.approx(peak / 2**20)
        assert len(ax.collections) == 4  # params, optimizer, grads, activations
        assert ax.get_xlabel() and ax.get_title()
    assert "MiB" in fig.axes[0].get_ylabel()


# ---------------------------------------------------------------------------------------
# 10. FSDP
# ---------------------------------------------------------------------------------------


def _fsdp_hand(prefetch):
    """3 blocks on 4 ranks, no latency: a block's all-gather and reduce-scatter take 1 s (the
    ring sends 3/4 of its 4 MB at 3 MB/s), forward 2 s, backward 4 s."""
    return diagrams.fsdp_timeline(3, 4e6, 4, t_forward=2, t_backward=4, alpha_s=0, bandwidth=3e6, prefetch=prefetch)


def test_fsdp_timeline_without_prefetch_by_hand():
    tl = _fsdp_hand(False)
    got = {name: (round(start, 9), round(end, 9)) for _, name, start, end in tl["ops"] if not name.startswith("AG")}
    assert got == (
        {
            "F0": (1, 3),
            "F1": (4, 6),
            "F2": (7, 9),
            "B2": (10, 14),
            "RS2": (14, 15),
            "B1": (15, 19),
            "RS1": (19, 20),
            "B0": (20, 24),
            "RS0": (24, 25),
        }
    )
    ags = [(s, e) for lane, _, s, e in tl["ops"] if lane == "all-gather"]
    assert ags == [pytest.approx(x) for x in [(0, 1), (3, 4), (6, 7), (9, 10), (14, 15), (19, 20)]]
    assert tl["t_end"] == pytest.approx(25)  # nothing overlaps but a reduce-scatter with the next all-gather


def test_fsdp_timeline_with_prefetch_by_hand():
    tl = _fsdp_hand(True)
    got = {name: (round(start, 9), round(end, 9)) for _, name, start, end in tl["ops"]}  # AGi: backward's
    assert got == (
        {
            "AG0": (12, 13),
            "F0": (1, 3),
            "AG1": (8, 9),
            "F1": (3, 5),
            "AG2": (7, 8),
            "F2": (5, 7),
            "B2": (8, 12),
            "RS2": (12, 13),
            "B1": (12, 16),
            "RS1": (16, 17),
            "B0": (16, 20),
            "RS0": (20, 21),
        }
    )
    ags = [(s, e) for lane, _, s, e in tl["ops"] if lane == "all-gather"]
    assert ags == [pytest.approx(x) for x in [(0, 1), (1, 2), (3, 4), (7, 8), (8, 9), (12, 13)]]  # each under a compute
    assert tl["t_end"] == pytest.approx(21)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fsdp_sends_the_zero_papers_one_and_a_half_all_reduces(n):
    """ZeRO-3 (Rajbhandari et al. 2019, section 7): 1.5x the 2(N-1)/N of the model a ring all-reduce sends."""
    blocks, block_bytes = 5, 3e6
    tl = diagrams.fsdp_timeline(blocks, block_bytes, n, t_forward=1e-3, t_backward=2e-3)
    assert tl["sent"] == pytest.approx(1.5 * 2 * (n - 1) / n * blocks * block_bytes)
    for prefetch in (False, True):
        ops = diagrams.fsdp_timeline(blocks, block_bytes, n, t_forward=1e-3, t_backward=2e-3, prefetch=prefetch)["ops"]
        names = [name for _, name, _, _ in ops]
        assert sum(x.startswith("AG") for x in names) == 2 * blocks and sum(x.startswith("RS") for x in names) == blocks
        for lane in ("compute", "all-gather", "reduce-scatter"):  # one stream each: no two ops at once
            spans = sorted((s, e) for ln, _, s, e in ops if ln == lane)
            assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))


def test_fsdp_figure_draws_every_op():
    model = memory.block_mlp(256, 4)
    fig = _quiet(diagrams.fsdp_figure, model, 4)
    assert len(fig.axes) == 2
    for ax in fig.axes:
        names = sorted(p.get_gid() for p in ax.patches if p.get_gid())
        want = [f"{k}{b}" for k in ("F", "B", "RS") for b in range(4)] + [f"AG{b}" for b in range(4)] * 2
        assert names == sorted(want)


# ---------------------------------------------------------------------------------------
# 11. The rendezvous
# ---------------------------------------------------------------------------------------


def test_rendezvous_numbers_nodes_as_torchs_rendezvous_sorts_them():
    hosts = ("nodeB", "nodeA", "nodeC")
    seq = diagrams.rendezvous_sequence(hosts, 2, arrival=("nodeC", "nodeA", "nodeB"))
    try:
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc
    except ImportError:  # pragma: no cover - torch's private class moved
        pytest.skip("torch's _NodeDesc is gone")
    theirs = sorted(_NodeDesc(h, 1000, 0) for h in hosts)  # torch assigns ranks over sorted participants
    assert [seq["node_rank"][d.addr] for d in theirs] == [0, 1, 2]
    assert seq["ranks"] == {
        0: {"host": "nodeA", "local_rank": 0, "world_size": 6},
        1: {"host": "nodeA", "local_rank": 1, "world_size": 6},
        2: {"host": "nodeB", "local_rank": 0, "world_size": 6},
        3: {"host": "nodeB", "local_rank": 1, "world_size": 6},
        4: {"host": "nodeC", "local_rank": 0, "world_size": 6},
        5: {"host": "nodeC", "local_rank": 1, "world_size": 6},
    }


def test_rendezvous_message_order():
    seq = diagrams.rendezvous_sequence(("node01", "node02"), 2, arrival=("node02", "node01"))
    msgs = seq["messages"]
    assert len(msgs) == 2 * 2 + 4 * 4
    assert msgs[:2] == [("agent node02", "store", "join (1 of 2)"), ("agent node01", "store", "join (2 of 2)")]
    assert msgs[2:4] == [
        ("store", "agent node02", "complete: node rank 1"),
        ("store", "agent node01", "complete: node rank 0"),
    ]
    index = {m: k for k, m in enumerate(msgs)}
    for r in range(4):
        start = next(k for k, (src, dst, _) in enumerate(msgs) if dst == f"rank {r}" and src.startswith("agent"))
        assert msgs[start][0] == f"agent node0{r // 2 + 1}"  # ranks 0, 1 on node01
        assert start < index[(f"rank {r}", "store", "init_process_group: my address")]
        assert index[("store", f"rank {r}", "all 4 ranks in")] > max(
            k for k, (src, dst, _) in enumerate(msgs) if dst == "store" and src.startswith("rank")
        )  # the store answers once every rank is in
    with pytest.raises(ValueError):
        diagrams.rendezvous_sequence(("a", "b"), 1, arrival=("a", "c"))


def test_rendezvous_figure_has_an_arrow_per_message():
    fig = _quiet(diagrams.rendezvous_figure, ("node01", "node02"), 2)
    seq = diagrams.rendezvous_sequence(("node01", "node02"), 2)
    arrows = [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]
    assert [a.get_gid() for a in arrows] == [f"msg:{s}->{d}" for s, d, _ in seq["messages"]]
    assert len(fig.axes[0].lines) == len(seq["lifelines"])


# ---------------------------------------------------------------------------------------
# 12. The roofline
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [8, 64])
def test_kernel_costs_against_flop_counter(n):
    a, b = torch.randn(n, n), torch.randn(n, n)
    with FlopCounterMode(display=False) as counter:
        torch.mm(a, b)
    fl, nbytes = diagrams.matmul_cost(n)
    assert fl == counter.get_total_flops() and fl / nbytes == pytest.approx(n / 6)
    fl, nbytes = diagrams.vector_add_cost(n)
    assert (fl, fl / nbytes) == (n, pytest.approx(1 / 12))  # notebook 02: one FLOP per 12 bytes


def test_roofline_by_hand():
    rl = diagrams.roofline(100.0, 10.0, {"slow": (50, 100, None), "fast": (2000, 10, 40.0)})
    assert rl["ridge"] == 10
    slow, fast = rl["points"]
    assert (slow["intensity"], slow["attainable"], slow["achieved"], slow["bound"]) == (0.5, 5.0, None, "memory")
    assert (fast["intensity"], fast["attainable"], fast["achieved"], fast["bound"]) == (200, 100.0, 50.0, "compute")
    with pytest.raises(ValueError):
        diagrams.roofline(0, 1, {})


def test_roofline_figure_points_and_roof():
    kernels = {"add": (*diagrams.vector_add_cost(1000), 1e-6), "mm": (*diagrams.matmul_cost(512), None)}
    fig = _quiet(diagrams.roofline_figure, 1e12, 50e9, kernels, "test")
    ax = fig.axes[0]
    lines = {ln.get_gid(): ln for ln in ax.lines if ln.get_gid()}
    roof = lines["roof"]
    assert np.allclose(roof.get_ydata(), np.minimum(1e12, roof.get_xdata() * 50e9) / 1e9)
    assert lines["point:add"].get_ydata()[0] == pytest.approx(1000 / 1e-6 / 1e9)  # measured: filled
    assert lines["point:mm"].get_ydata()[0] == pytest.approx(1e3) and lines["point:mm"].get_markerfacecolor() == "none"
    assert ax.get_xscale() == ax.get_yscale() == "log" and "GFLOP/s" in ax.get_ylabel()


# ---------------------------------------------------------------------------------------
# 13. Strong and weak scaling
# ---------------------------------------------------------------------------------------


def _simulated_speedups(n, f, work=1000.0):
    """One worker takes ``work`` seconds, ``f`` of it serial. Strong: the same work on n workers.
    Weak: n workers for the same time as one; the parallel part of the work grows n-fold."""
    strong = work / (f * work + (1 - f) * work / n)
    weak = (f * work + n * (1 - f) * work) / work
    return strong, weak


@pytest.mark.parametrize("f", [0.0, 0.05, 0.25, 1.0])
def test_scaling_speedup_against_a_simulation(f):
    workers = [1, 2, 3, 8, 100]
    got = diagrams.scaling_speedup(workers, f)
    for n, s, w in zip(workers, got["strong"], got["weak"]):
        assert (s, w) == pytest.approx(_simulated_speedups(n, f))
    assert got["strong"][0] == got["weak"][0] == pytest.approx(1)


def test_scaling_speedup_by_hand():
    got = diagrams.scaling_speedup([10, 10**9], 0.1)
    assert got["strong"][0] == pytest.approx(1 / 0.19) and got["weak"][0] == pytest.approx(9.1)
    assert got["strong"][1] == pytest.approx(10, rel=1e-6)  # Amdahl's ceiling, 1/f
    with pytest.raises(ValueError):
        diagrams.scaling_speedup([1, 2], 1.5)


def test_scaling_figure_curves():
    workers, fractions = (1, 2, 4, 8, 16), (0.05, 0.2)
    fig = _quiet(diagrams.scaling_figure, workers, fractions)
    assert len(fig.axes) == 2
    for ax, kind in zip(fig.axes, ("strong", "weak")):
        lines = {ln.get_gid(): ln for ln in ax.lines if ln.get_gid()}
        for f in fractions:
            assert list(lines[f"{kind}:{f:g}"].get_ydata()) == pytest.approx(diagrams.scaling_speedup(workers, f)[kind])
        assert ax.get_xlabel() == "workers N"
    assert sum(ln.get_linestyle() == ":" for ln in fig.axes[0].lines) == len(fractions)  # Amdahl's ceilings


# ---------------------------------------------------------------------------------------
# A GPT block split over ranks, and sequence parallelism's layouts
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("width,heads,n", [(16, 4, 2), (24, 6, 3), (32, 8, 4)])
def test_gpt_tp_owners_give_each_rank_whole_heads(width, heads, n):
    s = diagrams.gpt_tp_owners(width, heads, n)
    hw, per_rank = width // heads, heads // n
    for part in "qkv":  # by hand: head h on rank h // (heads / N), all of its features
        assert s[part]["owner"] == [(i // hw) // per_rank for i in range(width)]
        assert s[part]["label"] == [f"{part}{i // hw}" for i in range(width)]
    assert s["attn.proj"]["owner"] == s["q"]["owner"] and s["attn.proj"]["split"] == "inputs"
    for key in ("mlp.fc", "mlp.proj"):  # hidden units in N equal contiguous blocks
        assert s[key]["owner"] == [i // (4 * width // n) for i in range(4 * width)]
    # the fused weight cut in N contiguous pieces: rank r gets rows r*3d/N to (r+1)*3d/N
    fused = s["fused qkv"]
    assert fused["owner"] == [i // (3 * width // n) for i in range(3 * width)]
    rank0 = {lab for lab, o in zip(fused["label"], fused["owner"]) if o == 0}
    assert rank0 != {f"{p}{h}" for p in "qkv" for h in range(per_rank)}  # not its heads of q, k and v
    if n == 2:  # all of q and the first half of k
        assert rank0 == {f"q{h}" for h in range(heads)} | {f"k{h}" for h in range(heads // 2)}


def test_gpt_tp_figure_draws_a_cell_per_feature():
    width, heads, n = 16, 4, 2
    fig = _quiet(diagrams.gpt_tp_figure, width, heads, n)
    ax = fig.axes[0]
    cells = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_gid()]
    assert len(cells) == 3 * width + 4 * width + 2 * 4 * width  # fused, q, k, v, proj, fc, mlp proj
    s = diagrams.gpt_tp_owners(width, heads, n)
    colours = {r: diagrams._colour(r) for r in range(n)}
    for p in cells:
        key, i = p.get_gid().rsplit(":", 1)
        assert p.get_facecolor()[:3] == pytest.approx(colours[s[key]["owner"][int(i)]][:3])
    assert ax.get_title() and ax.get_xlabel()


def test_block_layouts_by_hand():
    tp, sp = diagrams.block_layouts(False), diagrams.block_layouts(True)
    assert [s["layout"] for s in tp["stages"]] == [
        "replicated", "replicated", "hidden", "replicated", "replicated", "hidden", "replicated"
    ]  # fmt: skip
    assert [s["layout"] for s in sp["stages"]] == [
        "sequence", "sequence", "hidden", "sequence", "sequence", "hidden", "sequence"
    ]  # fmt: skip
    pairs = lambda s: [(c["after"], c["forward"], c["backward"]) for c in s["collectives"]]  # noqa: E731
    assert pairs(tp) == [
        (1, None, "all-reduce"),
        (2, "all-reduce", None),
        (4, None, "all-reduce"),
        (5, "all-reduce", None),
    ]
    assert pairs(sp) == [
        (1, "all-gather", "reduce-scatter"),
        (2, "reduce-scatter", "all-gather"),
        (4, "all-gather", "reduce-scatter"),
        (5, "reduce-scatter", "all-gather"),
    ]


def test_sequence_parallel_figure_colours_every_stage_and_writes_every_collective():
    fig = _quiet(diagrams.sequence_parallel_figure)
    ax = fig.axes[0]
    for row, sp in enumerate((False, True)):
        s = diagrams.block_layouts(sp)
        boxes = sorted(
            (p.get_gid() for p in ax.patches if (p.get_gid() or "").startswith(f"{row}:stage:")),
            key=lambda g: int(g.split(":")[2]),
        )
        assert [g.split(":")[3] for g in boxes] == [st["layout"] for st in s["stages"]]
        for phase in ("forward", "backward"):
            written = [t.get_text().strip("()") for t in ax.texts if t.get_gid() == f"{row}:{phase}"]
            assert written == [c[phase] for c in s["collectives"] if c[phase]]


# ---------------------------------------------------------------------------- the GPT's state per rank


@pytest.mark.parametrize("rows", range(1, 10))
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_dim0_shard_numel_is_torch_chunks_split(rows, n):
    chunks = torch.chunk(torch.empty(rows, 3), n)  # FSDP2 splits dimension 0 as torch.chunk does
    want = [c.numel() for c in chunks] + [0] * (n - len(chunks))
    assert [shard.dim0_shard_numel((rows, 3), n, r) for r in range(n)] == want


def test_gpt_rank_bytes_divide_one_copy_by_units():
    from utils import gpt

    arch = gpt.GPTConfig(context=7, width=8, layers=3, heads=2)
    units = diagrams.gpt_units(arch)
    model = gpt.GPT(arch)
    assert list(units) == ["block 0", "block 1", "block 2", diagrams.GPT_REST]
    assert units["block 1"] == [tuple(p.shape) for p in model.blocks[1].parameters()]
    held = diagrams.gpt_rank_bytes(arch, 3)
    whole = 16 * gpt.parameter_count(arch)
    assert all(sum(r.values()) == whole for r in held["ddp"])
    assert sum(sum(r.values()) for r in held["fsdp2"]) == whole
    # by hand, 3 ranks, outside the blocks: the 256-row token table gives 86, 86 and 84 rows of 8,
    # the 7-row position table 3, 3 and 1, the final LayerNorm's weight and bias 3, 3 and 2 each
    rest = [16 * 8 * (p + t) + 16 * 2 * ln for (p, t), ln in zip(((3, 86), (3, 86), (1, 84)), (3, 3, 2))]
    assert [r[diagrams.GPT_REST] for r in held["fsdp2"]] == rest


def test_gpt_rank_bytes_figure_draws_every_rank_and_unit():
    from utils import gpt

    arch = gpt.GPTConfig(context=7, width=8, layers=2, heads=2)
    held = diagrams.gpt_rank_bytes(arch, 2)
    measured = {s: [sum(r.values()) for r in ranks] for s, ranks in held.items()}
    fig = diagrams.gpt_rank_bytes_figure(arch, 2, measured=measured)
    bars = {p.get_gid(): p for p in fig.axes[0].patches if p.get_gid()}
    for strategy, ranks in held.items():
        for r, units in enumerate(ranks):
            for unit, nbytes in units.items():
                assert bars[f"{strategy}:{r}:{unit}"].get_height() == pytest.approx(nbytes / MIB)
    marks = [line for line in fig.axes[0].lines if line.get_marker() == "x"]
    assert sorted(m.get_ydata()[0] for m in marks) == pytest.approx(sorted(v / MIB for v in sum(measured.values(), [])))
    ax = fig.axes[0]
    assert ax.get_title() and "MiB" in ax.get_ylabel()
