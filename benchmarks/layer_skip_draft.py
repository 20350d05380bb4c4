"""A draft model for speculative decoding cut from the target itself: its first N decoder layers, its
final norm and its LM head (an early-exit draft), written as a Hugging Face folder that shares the
target's tokenizer. It is no trained draft; it gives `spec_decode.py` a real draft model to run.

    python benchmarks/layer_skip_draft.py OUT_DIR [--model M] [--layers 4]
    python benchmarks/spec_decode.py --speculative-config '{"model": "OUT_DIR", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import shutil

from safetensors.torch import load_file, save_file

from roseinfer.loader.model_loader import resolve_model_folder

LAYER = re.compile(r"\.layers\.(\d+)\.")


def write_draft(model: str | None, layers: int, out: pathlib.Path) -> None:
    folder = resolve_model_folder(model)
    config = json.loads((folder / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        raise SystemExit(f"--layers must be in [1, {config['num_hidden_layers']})")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            m = LAYER.search(name)
            if m is None or int(m.group(1)) < layers:
                tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for path in folder.iterdir():  # tokenizer, chat template, generation config
        if path.suffix in (".json", ".jinja", ".txt", ".model") and path.name != "config.json" \
                and not path.name.startswith(("model", "roseinfer_")):
            shutil.copy(path, out / path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--model", default=None, help="the target (default: the embedded default model)")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    write_draft(args.model, args.layers, args.out)
    print(f"wrote a {args.layers}-layer draft to {args.out}")


if __name__ == "__main__":
    main()
