"""No silent wrong result: a checkpoint override is honoured, caches know the whole model, typos and data too
short are errors, held-out rows are held out, "auto" masking masks decode steps only, outputs honour the umask."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from slimwise_train.moe.adapters import get_adapter
from slimwise_train.moe.keepset import KeepSet
from slimwise_train.moe.masking import PhaseMasking
from slimwise_train.models import SHIPPED_TOKENIZER
from slimwise_train.prune.app import run_prune
from slimwise_train.prune.statistics import load_scores
from slimwise_train.testing.tiny import tiny_model

from helpers import CHILD_ENV as ENV
from helpers import compose_config

SMALL = ["progress=false", "data.num_samples=48", "data.batch_size=16", "data.seq_len=128"]


def save_checkpoint(folder: Path, num_experts: int = 12, seed: int = 0) -> Path:
    """A tiny stock Qwen3-MoE checkpoint with the shipped tokenizer, as a user's folder would look."""
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    model = tiny_model("qwen3_moe", seed=seed, num_experts=num_experts, vocab_size=len(tokenizer),
                       pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_app(args, cwd, app="slimwise_train.prune"):
    return subprocess.run([sys.executable, "-m", app, *args], cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=300)


def error_lines(proc, prog):
    return [line for line in proc.stderr.strip().splitlines() if line.startswith(f"{prog}: error:")]


# --------------------------------------------------------------------------- 1. model.path alone


@pytest.mark.subprocess
def test_model_path_alone_points_prune_at_the_checkpoint(tmp_path):
    ckpt = save_checkpoint(tmp_path / "my-moe-12e")
    proc = run_app([f"model.path={ckpt}", f"prune.cache_dir={tmp_path / 'cache'}", *SMALL], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = tmp_path / "outputs" / "prune" / "my-moe-12e" / "reap-r0.5"  # name derived from the folder
    keep = json.loads((out / "keep_set.json").read_text())
    assert [layer["num_experts"] for layer in keep["layers"]] == [12, 12]
    assert all(len(layer["kept"]) == 6 for layer in keep["layers"])
    summary = json.loads((out / "prune_summary.json").read_text())
    assert summary["model"].startswith(str(ckpt))


@pytest.mark.subprocess
def test_a_preset_with_both_path_and_tiny_is_an_error(tmp_path):
    ckpt = save_checkpoint(tmp_path / "ckpt")
    proc = run_app([f"model.path={ckpt}", "model.tiny=qwen3_moe", f"hydra.run.dir={tmp_path / 'run'}", *SMALL],
                   cwd=tmp_path)
    assert proc.returncode == 2
    assert "sets both model.path" in error_lines(proc, "slimwise_train.prune")[-1]
    assert not (tmp_path / "run" / "keep_set.json").exists()


def test_model_path_names_every_app_run_after_the_checkpoint():
    for app in ("prune", "train", "eval"):
        cfg = compose_config(app, "model.path=/data/ckpts/Qwen3-30B-A3B-ft")
        assert cfg.model.name == "Qwen3-30B-A3B-ft" and cfg.model.tiny is None
        default = compose_config(app)
        assert default.model.name == "tiny_qwen3_moe" and default.model.tiny == "qwen3_moe"


# --------------------------------------------------------------------------- 2. statistics cache key


def test_same_routers_different_experts_get_different_statistics(tmp_path):
    a = save_checkpoint(tmp_path / "a", seed=0)
    b_model = tiny_model("qwen3_moe", seed=0, num_experts=12,
                         vocab_size=len(AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))),
                         pad_token_id=0, eos_token_id=2)
    b_model = type(b_model).from_pretrained(a)
    with torch.no_grad():  # a fine-tune with frozen routers: only the experts move
        for layer in b_model.model.layers:
            layer.mlp.experts.down_proj.mul_(1.5)
    b_model.save_pretrained(tmp_path / "b")
    AutoTokenizer.from_pretrained(a).save_pretrained(tmp_path / "b")
    routers = [(n, p) for n, p in b_model.named_parameters() if n.endswith("mlp.gate.weight")]
    a_state = type(b_model).from_pretrained(a).state_dict()
    assert routers and all(torch.equal(p, a_state[n]) for n, p in routers)

    def prune(folder, run):
        cfg = compose_config("prune", f"model.path={folder}", f"output_dir={tmp_path / run}",
                             f"prune.cache_dir={tmp_path / 'cache'}", *SMALL)
        return run_prune(cfg)

    assert prune(a, "ra")["statistics"] == "computed"
    assert prune(tmp_path / "b", "rb")["statistics"] == "computed"  # not the cached statistics of a
    stats_a, meta_a = load_scores(tmp_path / "ra" / "scores.safetensors")
    stats_b, meta_b = load_scores(tmp_path / "rb" / "scores.safetensors")
    assert meta_a["model"]["weights_sha256"] != meta_b["model"]["weights_sha256"]
    # The first MoE layer sees the same inputs and routing, so EAN there is exactly 1.5x; later layers move too.
    assert torch.equal(stats_b.frequency[0], stats_a.frequency[0])
    torch.testing.assert_close(stats_b.ean_sum[0], 1.5 * stats_a.ean_sum[0], rtol=1e-6, atol=0)
    # ... and a scores file of a is refused for b.
    cfg = compose_config("prune", f"model.path={tmp_path / 'b'}", f"output_dir={tmp_path / 'rc'}",
                         f"prune.scores={tmp_path / 'ra' / 'scores.safetensors'}", *SMALL)
    with pytest.raises(ValueError, match="computed on another model.*weights_sha256"):
        run_prune(cfg)


# --------------------------------------------------------------------------- 3. unknown keys


@pytest.mark.parametrize("app,override,prog", [
    ("slimwise_train.prune", "+prune.ratoi=0.25", "slimwise_train.prune"),
    ("slimwise_train", "+distill.lr_rate=1e-3", "slimwise_train"),
])
@pytest.mark.subprocess
def test_unknown_key_added_with_plus_is_rejected(tmp_path, app, override, prog):
    proc = run_app([override, f"hydra.run.dir={tmp_path / 'run'}", *SMALL], cwd=tmp_path, app=app)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = error_lines(proc, prog)[-1]
    assert "unknown config key" in line and override[1:].split("=")[0] in line
    written = {p.name for p in (tmp_path / "run").iterdir()} if (tmp_path / "run").exists() else set()
    assert written <= {"prune.log", "train.log"}  # only Hydra's own job log


# --------------------------------------------------------------------------- 4. calibration data


def test_seq_len_one_is_refused(tmp_path):
    cfg = compose_config("prune", f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'c'}",
                         "progress=false", "data.seq_len=1")
    with pytest.raises(ValueError, match="data.seq_len=1"):
        run_prune(cfg)
    assert not (tmp_path / "out").exists()


def test_too_few_calibration_tokens_are_refused_with_the_count(tmp_path):
    cfg = compose_config("prune", f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'c'}",
                         "progress=false", "data.num_samples=4", "data.seq_len=8")
    with pytest.raises(ValueError, match=r"32 real calibration tokens, fewer than prune.min_calibration_tokens=1024"):
        run_prune(cfg)


def test_seq_len_beyond_the_models_positions_is_refused(tmp_path):
    cfg = compose_config("prune", f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'c'}",
                         "progress=false", "data.seq_len=4096")
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=256"):
        run_prune(cfg)


def test_blank_lines_of_a_text_file_are_not_sequences(tmp_path):
    from slimwise_train.config import DataConfig
    from slimwise_train.data.loading import load_pairs

    path = tmp_path / "calib.txt"
    path.write_text("first line of text\n\n   \nsecond line\n\n")
    pairs = load_pairs(DataConfig(source=str(path), num_samples=10, shuffle=False))
    assert [p.answer for p in pairs] == ["first line of text", "second line"]


def test_truncation_to_seq_len_is_reported(caplog):
    from slimwise_train.config import DataConfig
    from slimwise_train.data.loading import TextPair, encode_all

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    pairs = [TextPair("", "1 2 3 4 5 6 7 8 9 " * 4), TextPair("", "12")]
    with caplog.at_level("WARNING", logger="slimwise.data"):
        encoded = encode_all(tokenizer, pairs, DataConfig(seq_len=10, chat_template=False))
    assert len(encoded[0][0]) == 10 and len(encoded[1][0]) < 10
    assert "truncated 1 of 2 sequences to data.seq_len=10" in caplog.text


# --------------------------------------------------------------------------- 5. held-out rows


def _trainer(tmp_path, *overrides):
    from slimwise_train.distill.trainer import Trainer

    return Trainer(compose_config("train", f"output_dir={tmp_path / 'out'}", *overrides))


def test_local_jsonl_with_the_default_eval_split_holds_out_disjoint_rows(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}", "answer": f"A{i}"}) + "\n" for i in range(40)))
    trainer = _trainer(tmp_path, f"data.source={rows}", "data.num_samples=30", "distill.eval.samples=8")
    assert trainer.cfg.distill.eval.split != trainer.cfg.data.split
    train, held_out = trainer._load_pairs()
    assert len(train) == 30 and len(held_out) == 8 and not set(train) & set(held_out)


def test_a_named_split_that_repeats_training_rows_is_refused(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"Q{i}", "answer": f"A{i}"}) + "\n" for i in range(40)))
    recipe = tmp_path / "pinned.yaml"  # a recipe whose source pins its split: every split reads the same rows
    recipe.write_text(f"name: pinned\nsources:\n  - path: {rows}\n    split: train\n")
    trainer = _trainer(tmp_path, f"data.source={recipe}", "data.num_samples=30", "distill.eval.samples=8")
    with pytest.raises(ValueError, match="held-out rows .* are also training rows"):
        trainer._load_pairs()


# --------------------------------------------------------------------------- 6. "auto" masks decode steps only


@pytest.fixture
def masked_model():
    from transformers import DynamicCache

    model = tiny_model("qwen3_moe", seed=3)
    layers = get_adapter(model).moe_layers(model)
    keep = KeepSet.from_kept(layers, [[0, 2, 5, 7] for _ in layers])
    return model, PhaseMasking(model, keep), DynamicCache


def _run(model, masking, cache_cls, chunks, phases):
    """Feed `chunks` of token ids through one cache; phases[i] is the explicit phase or 'auto'."""
    cache, outs = cache_cls(config=model.config), []
    with torch.no_grad():
        for ids, phase in zip(chunks, phases):
            with masking.phase(phase):
                outs.append(model(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    return outs


def test_auto_runs_a_second_chat_turn_through_the_full_pool(masked_model):
    model, masking, cache_cls = masked_model
    g = torch.Generator().manual_seed(0)
    turn1, turn2 = torch.randint(3, 96, (2, 6), generator=g), torch.randint(3, 96, (2, 5), generator=g)
    steps = [torch.randint(3, 96, (2, 1), generator=g) for _ in range(4)]
    chunks = [turn1, steps[0], steps[1], turn2, steps[2], steps[3]]
    reference = _run(model, masking, cache_cls, chunks, ["prefill", "decode", "decode", "prefill", "decode", "decode"])
    auto = _run(model, masking, cache_cls, chunks, ["auto"] * len(chunks))
    for ref, got in zip(reference, auto):
        assert torch.equal(ref, got)
    # The test can tell: the second turn through the pruned pool gives other logits.
    wrong = _run(model, masking, cache_cls, chunks, ["prefill", "decode", "decode", "decode", "decode", "decode"])
    assert not torch.allclose(wrong[3], reference[3], atol=1e-4)


def test_auto_runs_a_chunked_prefill_through_the_full_pool(masked_model):
    model, masking, cache_cls = masked_model
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 96, (2, 9), generator=g)
    step = torch.randint(3, 96, (2, 1), generator=g)
    chunks = [prompt[:, :3], prompt[:, 3:6], prompt[:, 6:], step]
    reference = _run(model, masking, cache_cls, chunks, ["prefill", "prefill", "prefill", "decode"])
    auto = _run(model, masking, cache_cls, chunks, ["auto"] * 4)
    for ref, got in zip(reference, auto):
        assert torch.equal(ref, got)
    # The chunked prefill equals a one-shot prefill (same full pool) up to float reassociation.
    whole = _run(model, masking, cache_cls, [prompt, step], ["prefill", "decode"])
    torch.testing.assert_close(auto[2][:, -1], whole[0][:, -1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(auto[3], whole[1], atol=1e-4, rtol=1e-4)


def test_auto_with_hf_generate_masks_exactly_the_decode_steps(masked_model):
    model, masking, _ = masked_model
    prompt = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(2))
    seen = []
    def record(module, args, kwargs):
        seen.append((kwargs["input_ids"].shape[1], masking.masking_active))

    hook = model.register_forward_pre_hook(record, with_kwargs=True)
    masking.set_phase("auto")
    try:
        model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    finally:
        hook.remove()
        masking.set_phase("prefill")
    # The masking pre-hook was registered first, so it has decided by the time this hook runs.
    assert seen == [(7, False), (1, True), (1, True), (1, True)]


# --------------------------------------------------------------------------- 13. umask


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_atomic_writes_honour_the_umask(tmp_path, umask, mode):
    from slimwise_train.utils.atomic import atomic_dir, write_text_atomic

    old = os.umask(umask)
    try:
        write_text_atomic(tmp_path / "a.txt", "x")
        with atomic_dir(tmp_path / "d") as folder:
            (folder / "f").write_text("y")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.txt").stat().st_mode) == mode
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == mode | ((mode & 0o444) >> 2)


def test_prune_outputs_are_readable_by_the_group(tmp_path):
    old = os.umask(0o022)
    try:
        run_prune(compose_config("prune", f"output_dir={tmp_path / 'out'}", f"prune.cache_dir={tmp_path / 'c'}", *SMALL))
    finally:
        os.umask(old)
    for name in ("keep_set.json", "scores.safetensors", "router_mask.safetensors", "prune_summary.json"):
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o644, name
