import os

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Shared helpers (an app's composed config, the tiny runs' override lists, a CLI child's environment) are plain
# functions in tests/helpers.py, usable from module-scoped fixtures too. Tiers: markers in pyproject.toml; every test
# that starts a child process is marked `subprocess` (tests/test_layout.py checks it).


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    # Every test runs tiny models: intra-op threads only add OpenMP contention, which made them up to 100x
    # slower on a loaded 2-core machine. Subprocesses (torchrun, CLI tests) set their own threads.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def chat_tokenizer_dir(tmp_path_factory):
    """A tokenizer folder with a ChatML tool template whose assistant turns carry {% generation %} markers."""
    from helpers import write_chat_tokenizer

    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="session")
def chat_tokenizer_dir_no_markers(tmp_path_factory):
    """The same template without the markers: assistant turns are found by rendering prefixes."""
    from helpers import write_chat_tokenizer

    return write_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer_no_markers"), generation_markers=False)


# Saved tiny checkpoints, one per family, for the tests that read a checkpoint's files (layerwise calibration, the
# streamed export): written once per session, sharded into several small files so shard handling is exercised.
# DeepSeek-V3 gets a dense first layer (first_k_dense_replace=1), as the real model has three.
TINY_CHECKPOINT_OVERRIDES = {"deepseek_v3": dict(num_hidden_layers=3, first_k_dense_replace=1)}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(model_type) -> a folder with the tiny model of that family (the shipped tokenizer's vocabulary,
    saved with save_pretrained in 50 KB shards) and the tokenizer."""
    from transformers import AutoTokenizer

    from slimwise_train.models import SHIPPED_TOKENIZER
    from slimwise_train.testing.tiny import tiny_model

    root = tmp_path_factory.mktemp("tiny_checkpoints")
    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_TOKENIZER))
    saved: dict = {}

    def folder(model_type: str):
        if model_type not in saved:
            model = tiny_model(model_type, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                               eos_token_id=tokenizer.eos_token_id, **TINY_CHECKPOINT_OVERRIDES.get(model_type, {}))
            path = root / model_type
            model.save_pretrained(path, max_shard_size="50KB")
            tokenizer.save_pretrained(path)
            saved[model_type] = path
        return saved[model_type]

    return folder


@pytest.fixture(scope="session")
def served(tmp_path_factory):
    """The shipped teacher and its 50% REAP pruned checkpoint (scored on 24 suite prompts, keep set in
    root/keep_set.json), both as GGUF (f32): root, tokenizer, teacher, pruned (HF models), problems (10 per family).
    Shared by the llama.cpp tests (tests/test_serve_llamacpp.py, tests/test_serve_endpoint.py)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slimwise_train.data import synthetic
    from slimwise_train.eval.generation import build_problems, left_pad
    from slimwise_train.moe.adapters import get_adapter
    from slimwise_train.moe.keepset import KeepSet
    from slimwise_train.moe.pruning import export_pruned
    from slimwise_train.prune.criteria import reap, select_keep
    from slimwise_train.prune.statistics import collect_statistics
    from slimwise_train.serve import gguf

    teacher_dir = Path(synthetic.__file__).resolve().parents[2] / "assets" / "teacher"
    root = tmp_path_factory.mktemp("serve")
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    problems = build_problems(tokenizer, synthetic.FAMILIES, 10)
    calibration = build_problems(tokenizer, synthetic.FAMILIES, 8, seed=123)
    input_ids, mask = left_pad([p.prompt_ids for p in calibration], tokenizer.pad_token_id)
    with torch.no_grad():
        stats = collect_statistics(teacher, [{"input_ids": input_ids, "attention_mask": mask}], progress=False)
    kept = select_keep(reap(stats), 0.5, teacher.config.num_experts_per_tok)
    keep_set = KeepSet.from_kept(get_adapter(teacher).moe_layers(teacher), kept, model_type="qwen3_moe")
    keep_set.save(root / "keep_set.json")
    export_pruned(teacher, keep_set, root / "pruned", tokenizer=tokenizer)
    gguf.convert(teacher_dir, root / "teacher.gguf", log=lambda *_: None)
    gguf.convert(root / "pruned", root / "pruned.gguf", log=lambda *_: None)
    pruned = AutoModelForCausalLM.from_pretrained(root / "pruned").eval()
    return dict(root=root, tokenizer=tokenizer, teacher=teacher, pruned=pruned, problems=problems)


# --------------------------------------------------------------------------- realistic twins


class Twins:
    """`twins[preset]`: the folder of a preset's realistic twin (slimwise_train/twins), built on first use and cached
    across sessions by code version (tests/helpers.py `twin_folder`); `twins.tokenizer(preset)` its tokenizer, loaded
    once; `twins.presets` lists them."""

    def __init__(self):
        from slimwise_train.twins import PRESETS

        self.presets = PRESETS
        self._tokenizers = {}

    def __getitem__(self, preset: str):
        from helpers import twin_folder

        return twin_folder(preset)

    def tokenizer(self, preset: str):
        """The twin's tokenizer, loaded once per session (a 248k vocabulary takes seconds): do not change it."""
        if preset not in self._tokenizers:
            from transformers import AutoTokenizer

            self._tokenizers[preset] = AutoTokenizer.from_pretrained(self[preset])
        return self._tokenizers[preset]


@pytest.fixture(scope="session")
def twins():
    """Every preset's realistic twin, lazily: `twins["qwen3_5_moe_35b_a3b"]` is its folder (config.json, weights with
    the real names incl. MTP, tokenizer + chat template, slimwise_twin.json)."""
    return Twins()


class TwinGGUFs:
    """`twin_ggufs[preset]`: the twin converted by `serve gguf` (f32; the spec's --pre-tokenizer where llama.cpp does
    not recognise the tokenizer), once per session; `twin_ggufs.logs[preset]` holds what the conversion printed."""

    def __init__(self, twins, root):
        self.twins, self.root, self.files, self.logs = twins, root, {}, {}

    def __getitem__(self, preset: str):
        if preset not in self.files:
            from slimwise_train.serve.gguf import convert
            from slimwise_train.twins import spec_of

            lines = []
            self.files[preset] = convert(self.twins[preset], self.root / f"{preset}.gguf",
                                         pre_tokenizer=spec_of(preset).pre_tokenizer_flag, log=lines.append)
            self.logs[preset] = lines
        return self.files[preset]


@pytest.fixture(scope="session")
def twin_ggufs(twins, tmp_path_factory):
    """Every twin as GGUF, lazily, once per session (needs llama.cpp: mark tests `engine`)."""
    return TwinGGUFs(twins, tmp_path_factory.mktemp("twin-gguf"))


def pytest_terminal_summary(terminalreporter):
    from helpers import TWIN_BUILD_SECONDS

    built = {preset: seconds for preset, seconds in TWIN_BUILD_SECONDS.items() if seconds}
    if built:
        terminalreporter.write_line("twins built this session (s): "
                                    + ", ".join(f"{p} {s:.1f}" for p, s in built.items()))
