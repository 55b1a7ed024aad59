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
