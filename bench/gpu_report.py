"""bench/gpu_check.py's gpu_check.md: the results as tables."""

from __future__ import annotations


# ---------------------------------------------------------------- report

def markdown(result: dict) -> str:
    env = result["environment"]
    spec = f"{env['spec_tflops']:.0f}" if env["spec_tflops"] else "n/a"
    lines = [f"# gpu_check: {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), {env['date']}", "",
             f"Matmul {'8192^3 bf16' if env['memory_gib'] else '512^3 fp32'}: **{env['matmul_tflops']:.0f} TFLOP/s "
             f"measured**, spec {spec} TFLOP/s.", ""]
    c = result.get("checks")
    if c:
        lines += ["## train.py on one device", "",
                  f"- learns: **{c['learns']}** (loss {c['losses_fp32'][0]:.4f} -> {c['losses_fp32'][-1]:.4f} in {c.get('steps', 20)} steps)",
                  f"- resume from the step-{c.get('resumed_at', 10)} checkpoint is bitwise: **{c['resume_bitwise']}**",
                  f"- bf16 within 1e-2 of fp32: **{c['bf16_close']}** (largest relative loss difference "
                  f"{c['bf16_max_rel_diff']:.2e})", ""]
    s = result.get("shape")
    if s:
        lines += [f"## Throughput: {s['layers']} {s['flavor']} blocks ({s['params'] / 1e6:,.0f}M parameters), seq "
                  f"{s['seq_len']}, batch 1, {s['flops_per_token'] / 1e9:.4g} GFLOP/token", "",
                  "| row | tokens/s | TFLOP/s | MFU (spec) | MFU (matmul) | peak GiB | baseline tokens/s | ours / baseline "
                  "| step spread |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"
        for r in result["runs"]:
            if "tokens_per_second" not in r:
                lines.append(f"| {r['name']} | {r.get('skipped') or r.get('error')} | | | | | | | |")
                continue
            base = r["baseline_tokens_per_second"]
            lines.append(f"| {r['name']} | {r['tokens_per_second']:,.0f} | {r['tflops']:.0f} | {pct(r['mfu_spec'])} | "
                         f"{pct(r['mfu_matmul'])} | {r['peak_mem_gib']:.1f} | "
                         f"{'OOM' if base is None else format(base, ',.0f')} | {_num(r['ratio'], '.3f')} | "
                         f"{pct(r['step_spread'])} |")
        lines.append("")
    if result.get("memory"):
        lines += ["## Dry-run peak vs measured (eager rows)", "",
                  "| row | predicted GiB | max allocated GiB | max reserved GiB | predicted / allocated |",
                  "|---|---:|---:|---:|---:|"]
        for m in result["memory"]:
            alloc = m["max_allocated_gib"]
            ratio = m["predicted_gib"] / alloc if alloc else None
            lines.append(f"| {m['name']} | {m['predicted_gib']:.2f} | {_num(alloc, '.2f')} | "
                         f"{_num(m['max_reserved_gib'], '.2f')} | {_num(ratio, '.3f')} |")
        lines.append("")
    if result.get("document_masking"):
        lines += ["## Document masking (packed documents vs causal)", "",
                  "| seq | documents / sequence | causal tokens/s | masked tokens/s | masked / causal "
                  "| SDPA bool mask tokens/s | SDPA mask / causal | flex vs SDPA (out, grad) |",
                  "|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in result["document_masking"]:
            if "seq_len" not in r:
                lines.append(f"| {r.get('skipped') or r.get('error')} | | | | | | | |")
                continue
            agree = r.get("flex_vs_sdpa")
            agree = f"{agree['output_rel']:.1e}, {agree['grad_rel']:.1e}" if agree else "n/a"
            lines.append(f"| {r['seq_len']} | {r['documents_per_sequence']:.1f} | {r['causal_tokens_per_second']:,.0f} | "
                         f"{r['masked_tokens_per_second']:,.0f} | {r['masked_over_causal']:.3f} | "
                         f"{_num(r.get('masked_sdpa_tokens_per_second'), ',.0f')} | "
                         f"{_num(r.get('masked_sdpa_over_causal'), '.3f')} | "
                         f"{agree} |")
        lines.append("")
    moe = result.get("moe") or {}
    if moe.get("kernels"):
        lines += ["## Mixture of experts: one layer's experts, forward + backward (ms)", "",
                  "| tokens x k | dim | hidden | experts | max/mean | loop | grouped | padded |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in moe["kernels"]:
            lines.append(f"| {r['tokens']} x {r['top_k']} | {r['dim']} | {r['hidden']} | {r['experts']} | "
                         f"{r['max_over_mean']:.2f} | {_num(r['loop_ms'], '.1f')} | {_num(r['grouped_ms'], '.1f')} | "
                         f"{_num(r['padded_ms'], '.1f')} |")
        lines.append("")
    step = moe.get("step") or {}
    if "tokens_per_second" in step:
        lines += [f"MoE step (3 Qwen3-30B-A3B blocks, seq {step['seq_len']}, batch {step['batch']} in micro-batches of "
                  f"{step.get('micro_batch', step['batch'])}, bf16): "
                  f"**{step['tokens_per_second']:,.0f} tokens/s**, MFU on active parameters "
                  f"**{step['mfu_active']:.1f}%**, peak {step['peak_gib']:.1f} GiB.", ""]
    dense = moe.get("dense") or {}
    if "tokens_per_second" in dense:
        lines += [f"The same step with every block dense (FFN 6144 = 8 x 768, the same active size): "
                  f"{dense['tokens_per_second']:,.0f} tokens/s, MFU {dense['mfu']:.1f}%, peak "
                  f"{dense['peak_gib']:.1f} GiB; MoE / dense **{moe['moe_over_dense']:.2f}x**.", ""]
    elif dense:
        lines += [f"Dense twin failed: `{dense['error'].splitlines()[-1]}`", ""]
    if result.get("float8_curves", {}).get("runs"):
        from bench import float8_curves
        lines += float8_curves.markdown(result["float8_curves"])
    kernels = result.get("kernels") or {}
    if kernels.get("matmul"):
        lines += ["## Kernel speeds (bench/kernel_speeds.py)", "", "| m x k x n | TFLOP/s |", "|---|---:|"]
        lines += [f"| {r['m']} x {r['k']} x {r['n']} | {r['tflops']:.0f} |" for r in kernels["matmul"]]
        lines += ["", f"Copy {kernels['memory']['copy_gbs']:.0f} GB/s; attention (causal, d 128) " + ", ".join(
            f"{r['seq']}: {r['tflops']:.0f}" for r in kernels["attention"]) + " TFLOP/s by sequence.", ""]
    elif kernels:
        lines += [f"Kernel speeds: {kernels.get('skipped') or kernels.get('error')}", ""]
    speedup = result.get("float8_speedup") or {}
    if speedup.get("rows"):
        from bench import float8_speedup
        lines += ["## float8 over bf16, several micro-batches a step (bench/float8_speedup.py)", "",
                  *float8_speedup.markdown(speedup), ""]
    elif speedup:
        lines += [f"float8 over bf16 with micro-batches: {speedup.get('skipped') or speedup.get('error')}", ""]
    peer = result.get("peer") or {}
    if peer.get("rows"):
        lines += [f"## Side by side with torchtitan {peer['torchtitan']} (compiled, ac op)", "",
                  "| row | torchtitan tokens/s | meshtrain tokens/s | meshtrain / torchtitan |", "|---|---:|---:|---:|"]
        for r in peer["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['name']} | {r['skipped']} | | |")
                continue
            tps = lambda v: v.get("tokens_per_second")
            lines.append(f"| {r['name']} | {_num(tps(r['torchtitan']), ',.0f')} | {_num(tps(r['meshtrain']), ',.0f')} "
                         f"| {_num(r['ratio'], '.3f')} |")
        lines.append("")
    elif peer.get("skipped"):
        lines += [f"Side by side with torchtitan: skipped ({peer['skipped']}).", ""]
    loss = result.get("loss") or {}
    if loss.get("rows"):
        lines += [f"## The cross-entropy (bench/loss_memory.py): {loss['tokens']:,} tokens x {loss['vocab']:,} words, "
                  "bf16 logits", "", "| loss | bytes/logit at peak | ms fwd+bwd | max abs grad diff from plain |",
                  "|---|---:|---:|---:|"]
        lines += [f"| {name} | {r['bytes_per_logit']:.2f} | {r['ms']:.1f} | {r['grad_max_diff']:.1e} |"
                  for name, r in loss["rows"].items()]
        lines.append("")
    elif loss:
        lines += [f"Cross-entropy memory: {loss.get('skipped') or loss.get('error')}", ""]
    if result.get("optimizer", {}).get("lines"):
        lines += ["## Optimizer step (bench/muon_step.py)", "", "```", *result["optimizer"]["lines"], "```", ""]
    ops = result.get("operations") or {}
    if "oom_exit" in ops:
        lines += ["## Operations", "",
                  f"- [profiling] window: trace lists the steps **{ops['trace_has_steps']}**; allocator history "
                  f"events {ops.get('history_events')}",
                  f"- out of memory: exit {ops['oom_exit']}, message names the snapshot "
                  f"**{ops['oom_message_names_file']}**; snapshot segments {ops.get('oom_snapshot_segments')}, "
                  f"history events {ops.get('oom_history_events')}", ""]
    for section, err in result.get("errors", {}).items():
        lines += [f"**{section} failed:** `{err.splitlines()[-1] if err else ''}`", ""]
    lines.append(f"Whole command: {result['seconds']:.0f} s.")
    return "\n".join(lines) + "\n"


def _num(value, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)
