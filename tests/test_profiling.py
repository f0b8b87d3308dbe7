"""[profiling]: a one-process training run profiles exactly its window of steps, and the files
it writes are what torch.profiler and /proc produced (read here as plain JSON and text)."""

from __future__ import annotations

import json

from tests.in_process import refused, tiny_run, train_in_process

PHASES = ["token count", "forward/backward", "gradient clipping", "optimizer step", "loss reporting"]


def test_trace_and_memory_table_cover_exactly_the_window(tmp_path):
    result = train_in_process(*tiny_run(tmp_path, "prof", "--training.steps=5", "--checkpoint.enable=false",
                                        "--profiling.enable=true", "--profiling.start_step=2",
                                        "--profiling.steps=2"))
    assert result.code == 0, result.stderr[-2000:]
    folder = tmp_path / "prof" / "profile"
    assert sorted(p.name for p in folder.iterdir()) == ["rank0_steps2-3.pt.trace.json", "rank0_steps2-3_memory.txt"]

    events = [e for e in json.loads((folder / "rank0_steps2-3.pt.trace.json").read_text())["traceEvents"]
              if e.get("ph") == "X"]
    steps = {e["name"]: e for e in events if e["name"].startswith("meshtrain step ")}
    assert sorted(steps) == ["meshtrain step 2", "meshtrain step 3"]  # not 1, not 4 or 5
    for name, span in steps.items():
        inside = [e for e in events if e.get("cat") == "cpu_op"
                  and span["ts"] <= e["ts"] and e["ts"] + e["dur"] <= span["ts"] + span["dur"]]
        ops = {e["name"] for e in inside}
        # The model's matmuls, its attention and its optimizer ran inside each profiled step.
        assert "aten::mm" in ops, (name, sorted(ops))
        assert {"aten::scaled_dot_product_attention", "aten::_fused_adamw_"} <= ops, (name, sorted(ops))
        phases = [e["name"] for e in events if e.get("cat") == "user_annotation" and e["name"] in PHASES
                  and span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
        assert phases == PHASES, (name, phases)

    table = (folder / "rank0_steps2-3_memory.txt").read_text().splitlines()
    assert "steps 2-3" in table[0]
    rows = {line[:30].strip(): float(line.split()[-2]) for line in table[2:]}
    assert list(rows) == PHASES
    assert all(0 < gib < 1024 for gib in rows.values()), rows
    assert "\n".join(table) in result.stdout  # rank 0 prints it too


def test_profiling_off_writes_nothing_and_a_window_past_the_end_is_refused(tmp_path):
    result = train_in_process(*tiny_run(tmp_path, "off", "--training.steps=2", "--checkpoint.enable=false"))
    assert result.code == 0, result.stderr[-2000:]
    assert not (tmp_path / "off" / "profile").exists()
    message = refused(train_in_process(*tiny_run(tmp_path, "late", "--training.steps=2", "--profiling.enable=true",
                                                 "--profiling.start_step=3")))
    assert "--profiling.start_step=3" in message and "[training] steps = 2" in message, message
