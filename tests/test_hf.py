"""Hugging Face Llama conversion, checked against transformers' own forward: import (plain,
tied, pipeline stage, TP x FSDP shards on a fake 4-rank world), export (one file and
sharded), the export CLI on a DCP checkpoint, and clear errors on mismatched input."""

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

import transformers  # a dev dependency: the conversion is checked against its forward

from meshtrain.models.llama import Llama  # noqa: E402
from meshtrain.models.llama.hf import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    from_hf_name,
    half_to_interleaved,
    interleaved_to_half,
    load_hf_weights_,
    rotary_heads,
    save_hf,
    to_hf_name,
)
from meshtrain.models.llama.model import LlamaConfig  # noqa: E402
from meshtrain.parallel import ParallelDims, parallelize  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from meshtrain.training.export import main as export_main  # noqa: E402
from tests.forked_ranks import forked_python  # noqa: E402

# GQA, and Llama 3.1 rope scaling whose original length puts the head's four frequencies
# in all three regimes (kept, blended, divided by factor).
TINY = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=128, ffn_hidden=96,
            norm_eps=1e-5, rope_theta=10_000.0, rope_scaling=(8.0, 1.0, 4.0, 64), max_seq_len=128)


def hf_model(tied: bool = False, **overrides):
    """A random transformers Llama with every weight far from its default (norms too), so
    a swapped or unpermuted tensor changes the logits far beyond the tolerance."""
    cfg = LlamaConfig(**{**TINY, "tie_embeddings": tied, **overrides})
    hf_cfg = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    hf_model().save_pretrained(path)
    return path


def tokens():
    return torch.randint(0, TINY["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))


def random_llama(tied: bool = False) -> Llama:
    model = Llama(LlamaConfig(**{**TINY, "tie_embeddings": tied}))
    model.init_weights(seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def test_config_round_trip_and_refusals():
    cfg = LlamaConfig(**TINY)
    assert config_from_hf(config_to_hf(cfg)) == cfg
    plain = LlamaConfig(**{**TINY, "rope_scaling": None, "tie_embeddings": True})
    assert config_from_hf(config_to_hf(plain)) == plain
    # transformers 5 nests rope_theta and the scaling in rope_parameters.
    v5 = {**config_to_hf(cfg), "rope_parameters": {**config_to_hf(cfg)["rope_scaling"], "rope_theta": 5e5}}
    del v5["rope_theta"], v5["rope_scaling"]
    assert config_from_hf(v5).rope_theta == 5e5 and config_from_hf(v5).rope_scaling == cfg.rope_scaling
    for bad, match in [({"model_type": "mistral"}, "model_type"), ({"attention_bias": True}, "attention_bias"),
                       ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
                       ({"head_dim": 16}, "head_dim"), ({"hidden_act": "gelu"}, "hidden_act")]:
        with pytest.raises(ValueError, match=match):
            config_from_hf({**config_to_hf(cfg), **bad})


def test_names_and_permutation_are_inverse():
    cfg = LlamaConfig(**TINY)
    for name, _ in Llama(cfg).named_parameters():
        assert from_hf_name(to_hf_name(name)) == name
    assert to_hf_name("layers.1._checkpoint_wrapped_module.attention.wk.weight") == \
        "model.layers.1.self_attn.k_proj.weight"
    w = torch.randn(cfg.n_kv_heads * cfg.head_dim, cfg.dim)
    assert torch.equal(half_to_interleaved(interleaved_to_half(w, 2), 2), w)
    # Head 0, dimension pair i=1: our rows 2 and 3 become HF rows 1 and 1 + d/2.
    assert torch.equal(interleaved_to_half(w, 2)[[1, 5]], w[[2, 3]])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_import_matches_transformers(tmp_path, tied):
    hf = hf_model(tied)
    hf.save_pretrained(tmp_path)
    cfg = config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    assert cfg == LlamaConfig(**{**TINY, "tie_embeddings": tied})
    model = Llama.from_flavor("debug", meta=True, **vars(cfg))
    load_hf_weights_(model, tmp_path)
    with torch.no_grad():
        expected = hf(tokens()).logits
        torch.testing.assert_close(model(tokens()), expected, rtol=0, atol=1e-5)
        # The test can see a wrong permutation: without it the logits are far off.
        for i in range(cfg.n_layers):
            for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj")):
                getattr(model.layers[str(i)].attention, ours).weight.copy_(
                    hf.state_dict()[f"model.layers.{i}.self_attn.{theirs}.weight"])
        assert (model(tokens()) - expected).abs().max() > 1e-2


def test_import_into_pipeline_stage(hf_dir):
    full = Llama.from_flavor("debug", meta=True, **TINY)
    load_hf_weights_(full, hf_dir)
    stage = Llama.from_flavor("debug", meta=True, **TINY).pipeline_stage([1], first=False, last=True)
    load_hf_weights_(stage, hf_dir)
    full_params = dict(full.named_parameters())
    assert [n for n, _ in stage.named_parameters()][0].startswith("layers.1.")
    for name, p in stage.named_parameters():
        assert torch.equal(p, full_params[name]), name


def test_import_into_tp_fsdp_shards_reads_each_ranks_block(fake_world, tmp_path):
    """dp_shard 2 x tp 2: wk (16 rows) splits into half-heads per rank and the 130-row
    vocab unevenly (33/32), so this covers the partial-head read and FSDP's short shard."""
    hf = hf_model(vocab_size=130)
    hf.save_pretrained(tmp_path)
    cfg = LlamaConfig(**{**TINY, "vocab_size": 130})
    plain = {from_hf_name(k): v for k, v in hf.state_dict().items()}
    full = {k: half_to_interleaved(v, rotary_heads(k, cfg)) if rotary_heads(k, cfg) else v
            for k, v in plain.items()}
    # Colwise TP splits rows (dim 0), rowwise splits columns; norms are replicated over TP.
    tp_dim = {"wo": 1, "w2": 1, "attention_norm": None, "ffn_norm": None}
    for rank in range(4):
        fake_world(4, rank=rank)
        # One process plays every rank: DTensor caches output specs by mesh, and meshes
        # compare equal whatever the rank, so a cached spec would carry rank 0's coordinate.
        _clear_sharding_prop_cache()
        mesh = ParallelDims(dp_shard=2, tp=2, world_size=4).build_mesh("cpu")
        dp_rank, tp_rank = rank // 2, rank % 2  # tp innermost
        assert tuple(mesh.get_coordinate()) == (dp_rank, tp_rank)
        model = parallelize(Llama.from_flavor("debug", meta=True, **vars(cfg)), mesh)
        model.to_empty(device="cpu")
        load_hf_weights_(model, tmp_path)
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor), name
            expected = full[name]
            dim = tp_dim.get(name.split(".")[-2], None if name == "norm.weight" else 0)
            if dim is not None:
                expected = expected.chunk(2, dim=dim)[tp_rank]
            expected = expected.chunk(2, dim=0)[dp_rank]  # FSDP: dim 0 of the TP shard
            assert torch.equal(p.to_local(), expected), (rank, name)


@pytest.mark.parametrize("tied,max_shard_bytes", [(False, 5 * 10**9), (False, 40_000), (True, 5 * 10**9)],
                         ids=["one-file", "sharded", "tied"])
def test_export_loads_in_transformers(tmp_path, tied, max_shard_bytes):
    model = random_llama(tied)
    written = save_hf(model.state_dict().items(), model.cfg, tmp_path, max_shard_bytes=max_shard_bytes)
    if max_shard_bytes < 10**6:
        assert len(written) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
        assert written[0].name == f"model-00001-of-{len(written):05d}.safetensors"
    else:
        assert [p.name for p in written] == ["model.safetensors"]
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == tied
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens()).logits, model(tokens()), rtol=0, atol=1e-5)
    back = Llama.from_flavor("debug", meta=True, **TINY, tie_embeddings=tied)
    load_hf_weights_(back, tmp_path)
    for (name, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name


def run_export(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return forked_python("-m", "meshtrain.training.export", *map(str, args), env=env, timeout=120)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_cli_from_dcp_checkpoint(tmp_path, capsys):
    model = random_llama()
    ckpt = tmp_path / "step-10"
    dcp.save({"model": model.state_dict(), "extra": {"step": torch.tensor(10)}}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / "model_config.json").write_text(json.dumps(dataclasses.asdict(model.cfg)))

    proc = run_export(ckpt, tmp_path / "hf", "--format", "hf")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"meshtrain: exported {ckpt} to {tmp_path / 'hf'} (hf, ")  # one line when done
    back = Llama.from_flavor("debug", meta=True, **TINY)
    load_hf_weights_(back, tmp_path / "hf")
    for (name, a), (_, b) in zip(model.named_parameters(), back.named_parameters()):
        assert torch.equal(a, b), name

    proc = run_export(ckpt, tmp_path / "model.pt", "--format", "torch", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert sorted(state) == sorted(model.state_dict())
    assert list(state)[0] == "tok_embeddings.weight" and list(state)[-1] == "output.weight"
    for name, p in model.state_dict().items():
        assert state[name].dtype == torch.bfloat16 and torch.equal(state[name], p.to(torch.bfloat16)), name

    proc = run_export(tmp_path / "missing", tmp_path / "x", "--format", "hf")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("meshtrain: error: ") and "does not exist" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    (ckpt / "model_config.json").unlink()  # the same path in this process, to save a start-up
    assert export_main([str(ckpt), str(tmp_path / "x"), "--format", "hf"]) == 2
    assert "meshtrain: error: " in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "model_config.json").write_text("{}")
    assert export_main([str(tmp_path / "empty"), str(tmp_path / "x"), "--format", "torch"]) == 2
    assert "not a torch.distributed.checkpoint folder" in capsys.readouterr().err


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_torch_export_runs_in_a_model_built_by_its_constructor(tmp_path, capsys):
    # The FSDP1 full-state-dict replacement: export, then Llama(cfg).load_state_dict and run.
    # The rotary tables are not in a state dict; the constructor must fill them. Judged by
    # transformers' forward on the Hugging Face export of the same checkpoint.
    model = random_llama()
    ckpt = tmp_path / "checkpoint" / "step-00000010"
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt, no_dist=True)
    (ckpt / "model_config.json").write_text(json.dumps(dataclasses.asdict(model.cfg)))
    assert export_main([str(ckpt), str(tmp_path / "model.pt"), "--format", "torch"]) == 0
    assert export_main([str(ckpt), str(tmp_path / "hf"), "--format", "hf"]) == 0

    loaded = Llama(LlamaConfig(**TINY))
    loaded.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = loaded(tokens())
        assert torch.isfinite(logits).all()
        torch.testing.assert_close(logits, hf(tokens()).logits, rtol=0, atol=1e-5)

    # Pointed at the run's checkpoint folder instead of a step's: say which steps exist.
    assert export_main([str(tmp_path / "checkpoint"), str(tmp_path / "x.pt"), "--format", "torch"]) == 2
    err = capsys.readouterr().err
    assert "not one step's" in err and "steps saved: 10" in err and "step-00000010" in err, err


def test_mismatched_checkpoint_names_the_tensor(hf_dir, tmp_path):
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight has shape \(128, 64\) in the "
                                         r"checkpoint, but the model's tok_embeddings\.weight is \(256, 64\)"):
        load_hf_weights_(Llama.from_flavor("debug", meta=True, **{**TINY, "vocab_size": 256}), hf_dir)
    with pytest.raises(ValueError, match="n_layers 3 vs 2"):
        load_hf_weights_(Llama.from_flavor("debug", meta=True, **{**TINY, "n_layers": 3}), hf_dir)
    from safetensors.torch import load_file, save_file

    tensors = load_file(hf_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((hf_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight \(the model's layers\.1\."
                                         r"feed_forward\.w3\.weight\) is missing"):
        load_hf_weights_(Llama.from_flavor("debug", meta=True, **TINY), tmp_path)
