"""`specdraft-export`: a packed drafter in a format other runtimes load as it is.

    specdraft-export --format hf OUT [--model-dir model] [--teacher SPEC]
    specdraft-export --format gguf OUT.gguf [--model-dir model] [--gguf-type f32|f16|q8_0]
                     [--teacher SPEC | --tokenizer-gguf FILE]

hf: a transformers directory with the teacher's tokenizer and chat template (interop/hf_export.py), for
transformers' assisted generation, vLLM and SGLang; gguf: one GGUF file for llama.cpp (interop/gguf_export.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from drafter_lib.common.layout import REPO_ROOT
from drafter_lib.interop.gguf_export import GGUF_TYPES, export_gguf
from drafter_lib.interop.hf_export import export_hf


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description="Export a packed drafter to another format.")
    ap.add_argument("out", help="hf: output directory; gguf: output file")
    ap.add_argument("--format", choices=["hf", "gguf"], default="hf",
                    help="hf: a transformers directory (default); gguf: a GGUF file for llama.cpp")
    ap.add_argument("--model-dir", default=str(REPO_ROOT / "model"), help="packed model dir (default: model/)")
    ap.add_argument("--teacher", default=None,
                    help="the teacher spec whose tokenizer to write (default: the one the pack records, else the "
                         "default teacher)")
    ap.add_argument("--gguf-type", choices=GGUF_TYPES, default="f32",
                    help="gguf: type of the 2-D weights (default f32; norms stay F32)")
    ap.add_argument("--tokenizer-gguf", default=None,
                    help="gguf: a GGUF of the teacher whose tokenizer.* metadata to copy (default: the default "
                         "teacher's packaged GGUF, when that is the pack's teacher)")
    args = ap.parse_args(argv)
    if args.format == "hf":
        if args.tokenizer_gguf or args.gguf_type != "f32":
            ap.error("--gguf-type and --tokenizer-gguf apply to --format gguf only")
        export_hf(args.model_dir, args.out, teacher=args.teacher)
        out = Path(args.out)
    else:
        out = export_gguf(args.model_dir, args.out, gguf_type=args.gguf_type, teacher=args.teacher,
                          tokenizer_gguf=args.tokenizer_gguf)
    print(f"exported {args.model_dir} -> {out} ({args.format}{'' if args.format == 'hf' else ' ' + args.gguf_type})")
    return out


def cli(argv=None) -> None:
    """The console script: `main` without its return value (the written path), which a console script would
    print to stderr and exit 1 on."""
    main(argv)
