"""Memory accounting, activation checkpointing, ZeRO/FSDP2, tensor and pipeline parallelism,
against outside oracles: closed forms, one process, PyTorch's own implementations. Four process launches in all (shared
by module-scoped fixtures), small sizes."""

import math

import pytest
import torch

from utils import memory, parallel
from utils.demos import pp_demo, shard_demo, tp_demo
from utils.memory import parameter_bytes
from utils.parallel import pipeline, shard

pytestmark = pytest.mark.slow  # ranks: DDP, ZeRO-1 and FSDP2 on 2, an FSDP2 resume on 4, TP and PP on 2

# ---------------------------------------------------------------------------- memory (one process)


@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_saved_activation_bytes_equal_the_closed_form(amp):
    W, L, B = 16, 3, 8
    model = memory.block_mlp(W, L)
    got = memory.saved_bytes(model, torch.randn(B, W), forward=lambda m, x: m(x).float().pow(2), amp_dtype=amp)
    # hand count, fp32: per block 1 input (B x W) + GELU's input and output (B x 4W each), + the output
    want = (
        (L * (1 + 2 * 4) + 1) * B * W * 4
        if amp == "fp32"
        else L * 9 * B * W * 2 + (2 * L - 1) * 4 * W * W * 2 + B * W * 4
    )
    assert got == want == memory.mlp_activation_bytes(W, L, B, amp_dtype=amp)


@pytest.mark.parametrize("segment", [1, 2, 3])
def test_checkpointing_keeps_one_input_per_segment_and_matches_the_gradients(segment):
    W, L, B = 8, 6, 4
    x = torch.randn(B, W)
    plain, ck = memory.block_mlp(W, L), memory.block_mlp(W, L)
    fwd = memory.activation_checkpointed_forward(segment)
    plain(x).pow(2).mean().backward()
    with memory.count_forwards(ck) as calls:
        fwd(ck, x).pow(2).mean().backward()
    for a, b in zip(plain.parameters(), ck.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    assert calls.calls == [2] * L  # every block recomputed once
    # kept: one B x W input per segment, and the output the loss keeps
    want = (math.ceil(L / segment) + 1) * B * W * 4
    assert memory.saved_bytes(ck, x, forward=lambda m, i: fwd(m, i).pow(2)) == want
    assert want == memory.mlp_activation_bytes(W, L, B, segment=segment)


def test_cpu_peak_replays_allocations_in_order():
    def fn():
        a = torch.empty(1 << 20, dtype=torch.uint8)  # 1 MiB
        b = torch.empty(2 << 20, dtype=torch.uint8)  # 3 MiB live
        del a
        c = torch.empty(1 << 20, dtype=torch.uint8)  # 3 MiB live again, never 4
        del b, c

    assert memory.peak_bytes(fn) == 3 << 20


def test_cpu_held_bytes_counts_what_outlives_the_call():
    def fn():
        kept = torch.empty(3 << 20, dtype=torch.uint8)  # 3 MiB returned
        scratch = torch.empty(5 << 20, dtype=torch.uint8)  # 5 MiB freed before returning
        del scratch
        return kept

    held, out = memory.held_bytes(fn)
    assert held == 3 << 20 and out.numel() == 3 << 20


def test_held_bytes_sees_the_saved_tensors_of_a_forward():
    # the Linear's input and weight exist before the call; GELU saves its input, the Linear's output
    x = torch.randn(64, 32, requires_grad=True)
    lin = torch.nn.Linear(32, 16)
    held, out = memory.held_bytes(lambda: torch.nn.functional.gelu(lin(x)))
    assert held == 2 * out.numel() * 4  # GELU's input (saved) and its output (returned)


@pytest.mark.parametrize("opt", memory.OPTIMIZER_SETTINGS)
def test_budget_parts_are_exact_and_the_peak_within_tolerance(opt):
    W, L, B = 32, 2, 32
    pred = memory.budget(W, L, B, opt)
    model = memory.block_mlp(W, L)
    n = sum(p.numel() for p in model.parameters())
    assert pred["params"] == pred["grads"] == 4 * n == parameter_bytes(model)
    assert pred["optimizer"] == {"sgd": 0, "momentum": 4 * n, "adam": 8 * n}[opt]
    got = memory.measure_step(W, L, B, opt)
    assert got["optimizer"] == pred["optimizer"] and got["saved"] == pred["activations"]
    assert abs(got["peak"] / pred["peak"] - 1) < 0.25, (got["peak"], pred["peak"])


def test_budget_rejects_unknown_optimizer():
    with pytest.raises(ValueError, match="sgd, momentum, adam"):
        memory.budget(8, 1, 1, "lamb")


# ---------------------------------------------------------------------------- formulas


def test_zero_bytes_are_the_papers_formulas():
    P, N = 1_000_000, 8
    assert parallel.zero_bytes(P, N, 0)["total"] == 16 * P
    assert parallel.zero_bytes(P, N, 1)["total"] == 4 * P + 12 * P / N
    assert parallel.zero_bytes(P, N, 2)["total"] == 2 * P + 14 * P / N
    assert parallel.zero_bytes(P, N, 3)["total"] == 16 * P / N
    with pytest.raises(ValueError, match="stage"):
        parallel.zero_bytes(P, N, 4)


def test_ring_bytes():
    assert shard.ring_bytes("all_reduce", 100, 4) == 150
    assert shard.ring_bytes("all_gather", 100, 4) == shard.ring_bytes("reduce_scatter", 100, 4) == 75
    with pytest.raises(ValueError):
        shard.ring_bytes("gossip", 1, 2)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 16])
def test_schedules_bubble_and_memory(p, m):
    for kind in ("gpipe", "1f1b"):
        grid = pipeline.schedule(p, m, kind)
        assert pipeline.schedule_bubble(grid) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
        ops = sorted(x for row in grid for x in row if x)
        assert ops == sorted([("F", i) for i in range(m)] * p + [("B", i) for i in range(m)] * p)
        want = [m] * p if kind == "gpipe" else [min(p - s, m) for s in range(p)]
        assert pipeline.in_flight(grid) == want


def test_hand_gpipe_in_one_process_is_the_full_batch():
    """gpipe_step with one stage (no send/recv): micro-batches accumulate to the full batch."""
    torch.manual_seed(0)
    model, ref = memory.block_mlp(8, 2), memory.block_mlp(8, 2)
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    trace = []
    loss = pipeline.gpipe_step(model, x, y, 4, rank=0, world_size=1, trace=trace)
    pipeline.mse(ref(x), y).backward()
    assert float(loss) == pytest.approx(pipeline.mse(ref(x), y).item(), rel=1e-6)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7)
    assert [t[:2] for t in trace] == [("F", i) for i in range(4)] + [("B", i) for i in range(4)]
    with pytest.raises(ValueError, match="micro-batches"):
        pipeline.gpipe_step(model, x, y, 5, rank=0, world_size=1)


# ---------------------------------------------------------------------------- processes

KW = dict(width=16, depth=2, batch_size=8, steps=4)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    two = parallel.launch(shard_demo.worker, 2, save_dir=ckpt, save_after=2, measure_peak=False, timeout=240, **KW)
    four = parallel.launch(shard_demo.worker, 4, ("fsdp2",), resume_dir=ckpt, measure_peak=False, timeout=240, **KW)
    return two, four, ckpt


def test_every_strategy_trains_like_one_process(sharded):
    two, four, _ = sharded
    ref = shard_demo.reference_losses(**KW)
    for s in ("ddp", "zero1", "fsdp2"):
        assert two[0][s]["loss"] == pytest.approx(ref, rel=1e-6, abs=1e-6), s
    assert two[0]["fsdp2_bf16"]["loss"] == pytest.approx(ref, rel=2e-2)
    assert four[0]["fsdp2"]["loss"] == pytest.approx(ref[2:], rel=1e-6, abs=1e-6)  # resumed on 4


def test_per_rank_bytes_are_the_zero_formulas(sharded):
    two, four, _ = sharded
    P = sum(p.numel() for p in memory.block_mlp(KW["width"], KW["depth"]).parameters())
    for r in two:
        assert r["ddp"]["bytes"]["total"] == 16 * P
        assert r["fsdp2"]["bytes"]["total"] == r["fsdp2_bf16"]["bytes"]["total"] == 16 * P // 2
        assert r["zero1"]["bytes"]["params"] == r["zero1"]["bytes"]["grads"] == 4 * P
    assert sum(r["zero1"]["bytes"]["optimizer"] for r in two) == 8 * P
    assert all(r["fsdp2"]["bytes"]["total"] == 16 * P // 4 for r in four)


def test_fsdp_sends_one_and_a_half_times_ddp(sharded):
    two, _, _ = sharded
    P = sum(p.numel() for p in memory.block_mlp(KW["width"], KW["depth"]).parameters())
    ddp, fsdp = two[0]["ddp"]["comm"], two[0]["fsdp2"]["comm"]
    assert ddp["nbytes"]["all_reduce"] == 4 * P
    assert fsdp["calls"] == {"all_gather": 2 * KW["depth"], "reduce_scatter": KW["depth"]}
    assert fsdp["nbytes"] == {"all_gather": 2 * 4 * P, "reduce_scatter": 4 * P}
    assert fsdp["sent"] / ddp["sent"] == pytest.approx(1.5, rel=1e-2)


def test_dcp_export_is_the_gathered_state(sharded, tmp_path):
    two, _, ckpt = sharded
    plain = shard.export_checkpoint(ckpt, str(tmp_path / "model.pt"))
    saved = two[0]["saved_state"]
    assert plain.keys() == saved.keys() and all(torch.equal(plain[k], saved[k]) for k in saved)
    memory.block_mlp(KW["width"], KW["depth"]).load_state_dict(plain)


def test_tensor_parallel_by_hand_equals_one_process_and_parallelize_module():
    out = parallel.launch(tp_demo.worker, 2, width=8, batch_size=4, timeout=240, stream=False)
    for r in out:
        for k in ("y", "w1", "w2"):
            torch.testing.assert_close(r["hand"][k], r["ref"][k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(r["dtensor"][k], r["hand"][k], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["dtensor"]["x_grad"], r["hand"]["x_grad"])
        for impl in ("hand", "dtensor"):
            for phase in ("forward", "backward"):
                assert r[impl][phase] == {"calls": {"all_reduce": 1}, "nbytes": {"all_reduce": 4 * 8 * 4}}
        assert r["hand"]["shard_shapes"] == r["dtensor"]["shard_shapes"] == ((16, 8), (8, 16))


def test_pipeline_by_hand_and_with_pipelining_equal_one_process():
    out = parallel.launch(
        pp_demo.worker,
        2,
        width=8,
        depth=2,
        batch_size=8,
        micro_batches=(1, 2, 4),
        repeats=1,
        library_m=2,
        timeout=240,
        stream=False,
    )
    for r in out:
        assert all(v["grad_err"] < 1e-6 for v in r["hand"].values())
        assert all(v["grad_err"] < 1e-6 for v in r["library"].values())
    assert out[1]["library"]["1f1b"]["loss"] == pytest.approx(out[1]["ref_loss"], rel=1e-6)
    for m in (1, 2, 4):
        (traces,) = out[0]["hand"][m]["traces"]
        assert pipeline.executed_bubble(traces) == pytest.approx(pipeline.bubble_fraction(2, m), abs=1e-12)
        assert 0 <= pipeline.measured_bubble(traces) < 1
