"""Run llama.cpp's own convert_hf_to_gguf.py unchanged, with two additions made from outside (gguf.py says why):
an explicit pre-tokenizer where llama.cpp does not recognise the tokenizer, and the project's `slimwise.*` keys in
the GGUF header. A subprocess of `slimwise_train.serve.gguf.convert`, so the converter's imports and logging stay
out of the caller's process.

usage: python -m slimwise_train.serve._run_converter --source <llama.cpp dir> --metadata-json <json>
           --pre-tokenizer <name or ''> -- <converter arguments>
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

UNRECOGNISED_EXIT = 3  # = gguf.UNRECOGNISED_EXIT (not imported: this process never imports the project's torch code)


def main(argv: list[str]) -> None:
    split = argv.index("--")
    parser = argparse.ArgumentParser()
    parser.add_argument("--source", required=True)
    parser.add_argument("--metadata-json", required=True)
    parser.add_argument("--pre-tokenizer", default="")
    args = parser.parse_args(argv[:split])
    converter_args = argv[split + 1:]

    sys.path.insert(0, args.source)
    sys.path.insert(1, f"{args.source}/gguf-py")
    import gguf  # llama.cpp's gguf-py, the one the converter itself imports
    from conversion import base

    original_pre = base.TextModel.get_vocab_base_pre
    forced = args.pre_tokenizer or None

    def get_vocab_base_pre(self, tokenizer) -> str:
        if forced is not None:
            return forced
        try:
            return original_pre(self, tokenizer)
        except NotImplementedError:
            sys.stderr.write("llama.cpp does not recognise this tokenizer's pre-tokenizer: pass --pre-tokenizer NAME "
                             "(a llama.cpp pre-tokenizer such as default, gpt-2, llama3, qwen2; see docs/serving.md); "
                             "the conversion then checks the tokenization against transformers\n")
            sys.exit(UNRECOGNISED_EXIT)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    extra = json.loads(args.metadata_json)
    original_header = gguf.GGUFWriter.write_header_to_file

    def write_header_to_file(self, *a, **k):
        for key, value in extra.items():
            self.add_string(key, str(value))
        return original_header(self, *a, **k)

    gguf.GGUFWriter.write_header_to_file = write_header_to_file

    import convert_hf_to_gguf
    from conversion import get_model_class

    # transformers' classes hold no multi-token-prediction layers, so no checkpoint the project writes has them;
    # a converter that can export them (Qwen3-Next, Qwen3.5) would otherwise ask for their count.
    config = json.loads((Path(converter_args[0]) / "config.json").read_text())
    architecture = (config.get("architectures") or [""])[0]
    try:
        if getattr(get_model_class(architecture), "supports_mtp_export", False):
            converter_args = [*converter_args, "--no-mtp"]
    except NotImplementedError:
        pass  # the converter reports an unsupported architecture itself

    sys.argv = ["convert_hf_to_gguf.py", *converter_args]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main(sys.argv[1:])
