"""The held-out published runs (bench/step_time_validation.py, `held_out()`): every point is
estimated and its recorded published figure is the source's, so the table in
docs/planning.md ("Held-out points") cannot silently lose a row or drift from its source.
No assertion on the error: these points judge the planner, they do not tune it."""

import importlib.util
import math
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("step_time_validation", ROOT / "bench/step_time_validation.py")
validation = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(validation)

# As printed in the sources (KempnerForge's reports: total tok/s; Llama 3: TFLOP/s per GPU;
# llm-foundry's 70 rows are checked against their own MFU column below),
# copied here by hand so that an edit of the script's table shows.
PUBLISHED = {
    "KempnerForge mfu_scaling, run 1": 10_471, "KempnerForge mfu_scaling, run 2": 18_728,
    "KempnerForge mfu_scaling, run 3": 13_163, "KempnerForge mfu_scaling, run 4": 38_983,
    "KempnerForge mfu_scaling, run 5": 25_135, "KempnerForge mfu_scaling, run 6": 25_980,
    "KempnerForge mfu_scaling, run 7": 44_299, "KempnerForge mfu_scaling, run 8": 35_405,
    "KempnerForge mfu_scaling, run 9": 27_345, "KempnerForge mfu_scaling, run 10": 82_988,
    "KempnerForge mfu_scaling, run 11": 53_814, "KempnerForge mfu_scaling, run 12": 155_917,
    "KempnerForge mfu_scaling, run 13": 104_309, "KempnerForge mfu_scaling, run 14": 17_657,
    "KempnerForge weak_scaling_160gpu, run 13b_008": 29_860, "KempnerForge weak_scaling_160gpu, run 13b_032": 110_373,
    "KempnerForge weak_scaling_160gpu, run 13b_064": 216_507, "KempnerForge weak_scaling_160gpu, run 13b_128": 423_306,
    "KempnerForge weak_scaling_160gpu, run 13b_160": 534_644, "KempnerForge weak_scaling_160gpu, run 70b_008": 3_623,
    "KempnerForge weak_scaling_160gpu, run 70b_032": 18_688, "KempnerForge weak_scaling_160gpu, run 70b_064": 35_824,
    "KempnerForge weak_scaling_160gpu, run 70b_096": 52_190, "KempnerForge weak_scaling_160gpu, run 70b_128": 69_985,
    "KempnerForge weak_scaling_160gpu, run 70b_160": 85_571,
}
LLAMA3_TFLOPS_MFU = [(430, 43), (400, 41), (380, 38)]  # TFLOP/s per GPU, BF16 MFU %
# NVIDIA's DGXC recipes (v25.02.01): tok/s of the job, as each README's table prints it, in its order.
DGXC_TOK_S = [82028, 161443, 322638, 645277, 1275155,                                  # Llama 3.1 8B
              71756, 142663, 284881, 566797, 1129246, 2260623,                         # 70B
              114637, 116342, 119328, 117964, 234589, 466527,                          # 405B
              93223, 185654, 368568, 733526, 1470654, 2917777, 5795239, 11622595,      # Nemotron-4 15B
              28432, 56134, 111551, 221686, 433296,                                    # 340B
              63099, 124712, 249068, 496191, 988057,                                   # GPT-3 175B
              134752.43, 271581.46, 540537.92, 1075255.78, 2110607.12]                 # MaxText Llama 3 70B
# OLMo-core's README: tokens/s per device, 1B / 7B / 8B / 13B.
OLMO_CORE_TOK_S = [55_000, 10_000, 9_500, 4_600]
# fms-fsdp's README, H100 column: 7b, 34b, 70b eager (commit 4ffb9bd), 7b compiled (ed74fd5).
FMS_FSDP_TOK_S = [7500, 1550, 800, 9600]


def test_every_held_out_point_is_estimated_with_its_source_and_published_figure():
    rows = validation.evaluate(validation.held_out())
    kempner = [r for r in rows if r["source"].startswith("KempnerForge")]
    llama3 = [r for r in rows if r["source"].startswith("Llama 3")]
    mosaic = [r for r in rows if r["source"].startswith("llm-foundry")]
    dgxc = [r for r in rows if r["source"].startswith("NVIDIA DGXC")]
    olmo = [r for r in rows if r["source"].startswith("OLMo-core")]
    fms = [r for r in rows if r["source"].startswith("fms-fsdp")]
    assert len(rows) == len(kempner) + len(llama3) + len(mosaic) + len(dgxc) + len(olmo) + len(fms) == (
        len(PUBLISHED) + len(LLAMA3_TFLOPS_MFU) + 70 + len(DGXC_TOK_S) + len(OLMO_CORE_TOK_S) + len(FMS_FSDP_TOK_S))
    assert [r["published_value"] for r in olmo] == OLMO_CORE_TOK_S
    assert [r["published_value"] for r in fms] == FMS_FSDP_TOK_S
    assert {r["source"]: r["published_value"] for r in kempner} == PUBLISHED
    assert [(r["published_value"], r["published_mfu"]) for r in llama3] == LLAMA3_TFLOPS_MFU
    assert [r["published_value"] for r in dgxc] == DGXC_TOK_S
    for r in rows:
        assert r["url"].startswith("https://") and r["run"], r["source"]
        assert r["layout"].world_size == r["job"].world, r["source"]
        assert math.isfinite(r["estimated"]) and r["estimated"] > 0, r["source"]
        assert math.isfinite(r["error"]), r["source"]


def test_llm_foundry_rows_are_the_published_table():
    # All 70 bf16 rows of the two H100 tables; each row's published MFU is what llm-foundry's own
    # formula (README, "MFU": 6 x NumParams + 12 L d s per token over 989 TFLOP/s) gives for its
    # published tok/s/GPU, so a mistyped figure in either column shows; the shapes built here have
    # the published parameter counts.
    rows = [r for r in validation.held_out() if r["source"].startswith("llm-foundry")]
    assert len(rows) == len(validation.MOSAIC) == 70
    assert sum(r["published_value"] for r in rows) == 1_411_998  # summed from the README itself
    for size, seq, gpus, mfu, mb, accum, batch, tok_s, ac, params in validation.MOSAIC:
        dim, _, layers = validation.MPT_SIZES[size]
        assert abs(tok_s * (6 * params + 12 * layers * dim * seq) / 989e12 * 100 - mfu) < 0.05, (size, seq, gpus)
        assert validation.mpt_model(size, seq).n_params == params, (size, seq)


def test_dgxc_rows_are_the_published_tables():
    # Each README prints a run's step time and the job's tok/s; the tok/s is the sequence x global
    # batch over the step time (to the tables' rounding), so a mistyped figure in either column
    # shows; the layout multiplies to the GPUs and the batch splits into whole micro-batches.
    rows = [r for r in validation.held_out() if r["source"].startswith("NVIDIA DGXC")]
    assert len(rows) == len(validation.DGXC) == 40
    for r in rows:
        job, lay = r["job"], r["layout"]
        tokens = job.seq_len * job.global_batch
        assert math.isclose(tokens / r["published_step_s"], r["published_value"], rel_tol=5e-4), r["source"]
        assert r["url"].endswith(".md") and validation.DGXC_COMMIT in r["url"], r["source"]
        local = job.global_batch // (lay.dp_shard * lay.dp_replicate)
        assert local % lay.micro_batch == 0 and (lay.pp == 1 or lay.pp_microbatches * lay.micro_batch == local)


def test_published_figures_are_converted_to_tokens_per_second_per_gpu():
    for r in validation.held_out():
        if r["source"].startswith(("KempnerForge", "NVIDIA DGXC")):  # the job's tok/s over its GPUs
            assert r["measured"] == r["published_value"] / r["job"].world
        elif r["source"].startswith(("llm-foundry", "OLMo-core", "fms-fsdp")):  # published per GPU
            assert r["measured"] == r["published_value"]
        else:  # TFLOP/s per GPU over physics/flops.py's FLOPs per token
            m, s = r["job"].model, r["job"].seq_len
            assert math.isclose(r["measured"] * m.flops_per_token(s), r["published_value"] * 1e12)


def test_olmo_core_rows_are_the_published_shapes():
    # Each script's model is OLMo-core's llama_like: FFN = 256-multiple ceiling of 8/3 d (Llama
    # 3 8B: 1.3 x that, to a multiple of 1,024), no biases, untied; dolma2's 100,278 words
    # padded to a multiple of 128. The global batch splits into whole micro-batches over 8 GPUs.
    for size, commit, script, dim, layers, heads, kv, ffn, mb, batch, tok_s in validation.OLMO_CORE:
        multiple, scale = (1024, 1.3) if size == "8B" else (256, 1.0)
        assert ffn == multiple * -(-int(scale * int(8 * dim / 3)) // multiple), size
        assert batch % (8 * mb) == 0 and len(commit) == 40, size
    rows = [r for r in validation.held_out() if r["source"].startswith("OLMo-core")]
    assert [r["job"].model.vocab for r in rows] == [128 * -(-100_278 // 128)] * 4
    assert all(not r["job"].model.tied and r["job"].compiled and r["layout"].ac == "none" for r in rows)


def test_fms_fsdp_rows_are_the_published_layouts():
    # fms's Llama 2 shapes (LLaMAConfig: 7b's FFN the 256-multiple ceiling of 8/3 d, 34b's and
    # 70b's hidden_grow_factor x d), vocabulary 32,000, untied; 96 GPUs in nodes of 8, HSDP
    # sharded over a node, FSDP over all; bf16 reductions (bfSixteen); batch 2 a GPU, one
    # micro-batch a step; the node's 800 Gb/s as the NICs' sum.
    rows = [r for r in validation.held_out() if r["source"].startswith("fms-fsdp")]
    assert [r["job"].model.ffn_hidden for r in rows] == [256 * -(-int(8 * 4096 / 3) // 256), 22_016, 28_672, 11_008]
    for r in rows:
        job, lay = r["job"], r["layout"]
        assert job.model.vocab == 32_000 and not job.model.tied and job.reduce_dtype == "bfloat16"
        assert job.world == 96 and job.global_batch == 96 * 2 and lay.micro_batch == 2
        assert job.net.nics_per_node * job.net.nic_bandwidth * 8 == 800e9
        assert (lay.dp_shard, lay.dp_replicate) == ((8, 12) if "HSDP" in r["run"] else (96, 1))
        assert r["url"].startswith("https://github.com/foundation-model-stack/fms-fsdp/blob/")


def test_held_out_points_are_not_among_the_calibration_rows():
    calibration = {r["source"] for r in validation.ours() + validation.torchtitan() + validation.megatron()}
    assert not calibration & {r["source"] for r in validation.held_out()}


def test_the_docs_error_tables_are_the_scripts_current_output():
    # docs/planning.md's two tables and its three summary lines are what `python
    # bench/step_time_validation.py --write-doc` writes: a planner change that moves an estimate
    # fails here until the tables are regenerated by that one command.
    doc = validation.DOC.read_text()
    calibration = validation.evaluate(validation.ours() + validation.torchtitan() + validation.megatron())
    held = validation.evaluate(validation.held_out())
    marked = validation.marked_lines(held)
    fresh = validation.with_tables(doc, [validation.calibration_table(calibration), validation.held_out_table(held)],
                                   marked)
    stale = [(a, b) for a, b in zip(doc.split("\n"), fresh.split("\n")) if a != b]
    assert fresh == doc, ("docs/planning.md's error tables are stale; run python bench/step_time_validation.py "
                          f"--write-doc ({len(stale)} lines differ, the first: {stale[:1]})")
    # The rewrite replaces a table whole: a row dropped from the script leaves the doc too.
    shorter = validation.with_tables(doc, [validation.calibration_table(calibration[:-1]),
                                           validation.held_out_table(held)], marked)
    assert len(shorter.split("\n")) == len(doc.split("\n")) - 1


def test_the_sources_losses_are_planned_at_what_their_torch_ops_move():
    """Around their fused cross-entropy kernels (whose loads and stores are read off their code)
    the sources run torch ops over the logits, counted here as planning/kernels.py counts
    meshtrain's losses: Composer's train metrics after each micro-batch's backward, an fp32
    cross-entropy each under bf16 autocast, forward only; OLMo-core's cut of the last position,
    a copy unless a micro-batch is one sequence, and its backward."""
    from tests.test_chunked_loss import LogitTraffic

    tokens, vocab = 512, 4096
    big = tokens * vocab // 8
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0))
    with LogitTraffic(big) as metric, torch.no_grad():
        F.cross_entropy(logits[0].float(), labels, reduction="sum")
    assert metric.bytes / logits.numel() == validation.METRIC_BYTES
    assert validation.MOSAIC_LOSS_BYTES == validation.XENTROPY_BYTES + 2 * validation.METRIC_BYTES
    x = logits[0].clone().requires_grad_()
    with LogitTraffic(big) as kempnerforge:  # its loss: the bf16 logits as they are
        torch.autograd.grad(F.cross_entropy(x, labels, ignore_index=-100), x)
    assert kempnerforge.bytes / x.numel() == validation.KEMPNERFORGE_LOSS_BYTES
    assert all(r["job"].loss_bytes == validation.KEMPNERFORGE_LOSS_BYTES for r in validation.kempnerforge_rows())
    for micro_batch in (1, 2):
        x = torch.randn(micro_batch, tokens, vocab, dtype=torch.bfloat16).requires_grad_()
        upstream = torch.ones(micro_batch, tokens - 1, vocab, dtype=torch.bfloat16)  # the loss's gradient
        with LogitTraffic(big) as cut:
            kept = x[..., :-1, :].contiguous()
            torch.autograd.grad(kept, x, upstream)
        assert round(cut.bytes / x.numel()) == validation.olmo_core_loss_bytes(0, micro_batch)
    mosaic = validation.mosaic_rows()
    assert all(r["job"].loss_bytes == validation.MOSAIC_LOSS_BYTES for r in mosaic)
    olmo = validation.olmo_core_rows()
    assert [r["job"].loss_bytes for r in olmo] == [16, 14, 14, 10]  # 1B compiled (8), the others' kernel (6); 13B one sequence
