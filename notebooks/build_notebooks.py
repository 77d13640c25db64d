"""Writes the five study notebooks (thin: a papermill `parameters` cell, calls into drafter_lib, tables, plots).

    python notebooks/build_notebooks.py        # regenerate notebooks/0*.ipynb after editing this file

Parameter defaults here are the `default` preset's; `python -m drafter_lib.study` injects a preset's values.
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # drafter_lib from this checkout


def _params(*names, **extra) -> str:
    """The parameters cell: `names` take the default preset's values (so notebook and preset never drift)."""
    from drafter_lib.presets import PRESETS

    kw = {"run_dir": "runs/default", **{n: PRESETS["default"][n] for n in names}, **extra}
    return "\n".join(f"{k} = {v!r}" for k, v in kw.items())


COMMON = "import json\nfrom pathlib import Path\n\nimport pandas as pd\nfrom IPython.display import Image, display\n"

NOTEBOOKS = {
    "01_data": [
        new_markdown_cell("# 01 - Prompt data\nBuild the prompt set: sources -> dedup -> length filter (teacher "
                          "tokens) -> held-out split by id hash -> mixture. Writes `data/train.jsonl`, "
                          "`data/heldout.jsonl` and `architecture.json` (every corpus and model with its revision, "
                          "seed or sha256)."),
        _params('num_threads', 'teacher', 'drafter_base', 'seed', 'shared_data', 'synthetic_n', 'total_prompts',
                'source_weights', 'heldout_frac', 'min_prompt_tokens', 'max_prompt_tokens', 'humaneval'),
        COMMON + "from drafter_lib import data, hf_models, plots, study\n\n"
                 "study.init_notebook(num_threads)\nrun = Path(run_dir)\n"
                 "teacher_spec = study.resolve_model(teacher, run)\n"
                 "drafter_spec = study.resolve_model(drafter_base, run, fallback=teacher_spec)\n"
                 "tok = study.load_tokenizer(teacher_spec)\n"
                 "sources = data.default_sources(study.shared_data_dir(shared_data), synthetic_n=synthetic_n, "
                 "seed=seed, humaneval=humaneval)\n"
                 "models = [hf_models.model_record(teacher_spec, role='teacher'),\n"
                 "          hf_models.model_record(drafter_spec, role='drafter_base')]\n"
                 "summary = data.build_prompt_set(run / 'data', sources=sources, weights=source_weights, "
                 "total=total_prompts,\n"
                 "                                tokenizer=tok, min_tokens=min_prompt_tokens, "
                 "max_tokens=max_prompt_tokens,\n"
                 "                                heldout_frac=heldout_frac, seed=seed, "
                 "architecture_path=run / 'architecture.json', models=models)\n"
                 "print(f\"train {summary['train']}  heldout {summary['heldout']}  duplicates dropped "
                 "{summary['duplicates_dropped']}  length-filtered {summary['length_dropped']}\")",
        "pd.DataFrame(summary['by_source']).T",
        "cats = pd.DataFrame(summary['by_category']).fillna(0).astype(int)\n"
        "cats.sort_values('train', ascending=False).head(30)",
        "train = data.load_prompt_file(run / 'data' / 'train.jsonl')\n"
        "held = data.load_prompt_file(run / 'data' / 'heldout.jsonl')\n"
        "lengths = {'train': data.token_lengths(train, tok), 'heldout': data.token_lengths(held, tok)}\n"
        "by_src = {}\n"
        "for r, n in zip(train, lengths['train']):\n"
        "    by_src.setdefault(r['source'], []).append(n)\n"
        "p1 = plots.length_histogram(lengths, run / 'plots' / 'prompt_lengths.png', xlabel='prompt tokens',\n"
        "                            title='Prompt length (teacher tokens)')\n"
        "p2 = plots.length_histogram(by_src, run / 'plots' / 'prompt_lengths_by_source.png', "
        "xlabel='prompt tokens',\n"
        "                            title='Train prompt length by source')\n"
        "p3 = plots.bar_counts({k: v['train'] for k, v in summary['by_source'].items()}, "
        "run / 'plots' / 'prompts_by_source.png',\n"
        "                      title='Train prompts per source')\n"
        "for p in (p1, p2, p3):\n"
        "    display(Image(str(p)))",
        "arch = json.loads((run / 'architecture.json').read_text())\n"
        "pd.DataFrame([{k: c.get(k) for k in ('name', 'source', 'revision', 'commit', 'seed', 'input_sha256', "
        "'sha256')} for c in arch['corpora'] + arch['models']])",
    ],
    "02_teacher": [
        new_markdown_cell("# 02 - Teacher targets\nGreedy continuations of the training prompts by the teacher "
                          "(batched; resumable: rows already in `teacher/targets.jsonl` are skipped)."),
        _params('num_threads', 'teacher', 'device', 'teacher_max_new_tokens', 'teacher_batch_size',
                'teacher_backend'),
        COMMON + "from drafter_lib import data, hf_models, plots, study, teacher as teacher_lib\n\n"
                 "study.init_notebook(num_threads)\nrun = Path(run_dir)\n"
                 "teacher_spec = study.resolve_model(teacher, run)\n"
                 "model, tok = hf_models.load_teacher(teacher_spec, device=device)\n"
                 "records = data.load_prompt_file(run / 'data' / 'train.jsonl')\n"
                 "stats = teacher_lib.generate_targets(records, model, tok, run / 'teacher' / 'targets.jsonl',\n"
                 "                                     max_new_tokens=teacher_max_new_tokens, "
                 "batch_size=teacher_batch_size,\n"
                 "                                     backend=teacher_backend, teacher_id=teacher)\n"
                 "(run / 'teacher' / 'stats.json').write_text(json.dumps(stats, indent=2))\n"
                 "stats",
        "rows = teacher_lib.read_rows(run / 'teacher' / 'targets.jsonl')\n"
        "stop = set(teacher_lib.stop_token_ids(tok))\n"
        "df = pd.DataFrame({'category': [r['category'] for r in rows],\n"
        "                   'prompt_tokens': [len(r['prompt_ids']) for r in rows],\n"
        "                   'continuation_tokens': [len(r['continuation_ids']) for r in rows],\n"
        "                   'stopped': [bool(r['continuation_ids']) and r['continuation_ids'][-1] in stop "
        "for r in rows]})\n"
        "print(f'{len(df)} rows, {df.continuation_tokens.sum()} target tokens, '\n"
        "      f'{df.stopped.mean():.0%} ended with a stop token')\n"
        "df.groupby('category').agg(rows=('stopped', 'size'), mean_prompt=('prompt_tokens', 'mean'),\n"
        "                           mean_continuation=('continuation_tokens', 'mean'), stopped=('stopped', 'mean'))",
        "p = plots.length_histogram({'continuation': df.continuation_tokens.tolist()}, "
        "run / 'plots' / 'continuation_lengths.png',\n"
        "                           xlabel='teacher tokens', title='Teacher continuation length')\n"
        "display(Image(str(p)))\n"
        "# an example from the embedded synthetic prompts: external corpora's text stays out of committed notebooks\n"
        "ex = next((r for r in rows if str(r.get('source', '')).startswith('synthetic')), rows[0])\n"
        "print(repr(tok.decode(ex['prompt_ids'] + ex['continuation_ids']))[:600])",
    ],
    "03_train_qat": [
        new_markdown_cell("# 03 - Distill, then QAT\nThe drafter starts as a layer-pruned copy of its base, is "
                          "distilled on the teacher's continuations (loss on continuation tokens), then trained "
                          "with fake quantization (the packer's exact quantizer). Resumable from checkpoints."),
        _params('num_threads', 'teacher', 'drafter_base', 'keep_layers', 'seed', 'train'),
        COMMON + "from drafter_lib import study\nfrom drafter_lib.train import TrainConfig, plot_losses, "
                 "run_training\n\n"
                 "study.init_notebook(num_threads)\nrun = Path(run_dir)\n"
                 "teacher_spec = study.resolve_model(teacher, run)\n"
                 "cfg = TrainConfig.from_dict({**dict(train or {}), 'train_path': str(run / 'teacher' / "
                 "'targets.jsonl'),\n"
                 "                             'out_dir': str(run / 'train'), 'seed': seed,\n"
                 "                             'base_model': study.resolve_model(drafter_base, run, "
                 "fallback=teacher_spec),\n"
                 "                             'keep_layers': keep_layers, 'teacher_model': teacher_spec})\n"
                 "result = run_training(cfg)\n"
                 "print({k: v for k, v in result.items() if k != 'history'})",
        "hist = pd.DataFrame(result['history'])\n"
        "display(hist[hist.kind == 'val'][['step', 'phase', 'loss']])\n"
        "p = plot_losses(result['history'], run / 'plots' / 'losses.png')\n"
        "display(Image(str(p)))",
        "info = json.loads((run / 'train' / 'best' / 'train_info.json').read_text())\n"
        "info",
    ],
    "04_pack": [
        new_markdown_cell("# 04 - Pack\nPack the QAT checkpoint (int4 group-wise linears, int8 embeddings) into "
                          "the shipped model-dir format, reload it through the engine, measure what quantization "
                          "cost. `publish=True` copies the pack to the repo's `model/`."),
        _params('num_threads', 'copy_policy', 'publish', checkpoint='best', publish_dir=None),
        COMMON + "import shutil\n\nimport torch\nfrom transformers import AutoModelForCausalLM\n\n"
                 "from drafter_lib import pack, quantization as Q, study\n"
                 "from drafter_lib.engine import DraftEngine\n"
                 "from drafter_lib.evaluate import speculative_generate\n"
                 "from drafter_lib.model_dir import read_model_dir\n\n"
                 "study.init_notebook(num_threads)\nrun = Path(run_dir)\n"
                 "ckpt = run / 'train' / checkpoint\n"
                 "qconfig = Q.QuantConfig.from_dict(json.loads((run / 'train' / 'best' / "
                 "'qat_quant_config.json').read_text()))\n"
                 "model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()\n"
                 "out = pack.pack_checkpoint(model, model.config, run / 'model', qconfig, copy_policy=copy_policy,\n"
                 "                           extra_manifest={'run': run.name, 'checkpoint': checkpoint})\n"
                 "packed = read_model_dir(out)  # verifies sha256 of every file\n"
                 "sizes = {p.name: p.stat().st_size for p in sorted(Path(out).iterdir())}\n"
                 "fp_bytes = sum(v.numel() * 4 for v in model.state_dict().values())\n"
                 "print(f\"packed {sizes['weights.safetensors'] / 1e6:.2f} MB vs fp32 {fp_bytes / 1e6:.2f} MB\")\n"
                 "sizes",
        "fp_sd = model.state_dict()\n"
        "rows = pack.weight_error_table(fp_sd, packed.state_dict)\n"
        "err = pd.DataFrame(rows)\n"
        "display(err.groupby('kind').rel_error.agg(['mean', 'max']))\n"
        "display(Image(str(pack.plot_weight_error(rows, run / 'plots' / 'weight_error.png'))))",
        "# Reload check: the packed weights must be exactly the fake-quant weights QAT trained with, and the engine\n"
        "# (which reads only the model dir) must draft what the fake-quant HF model drafts greedily.\n"
        "fq = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()\n"
        "Q.apply_fake_quant(fq, qconfig)\n"
        "with torch.no_grad():\n"
        "    exact = all(torch.equal(getattr(fq.get_submodule(n.rsplit('.', 1)[0]), n.rsplit('.', 1)[1]), "
        "packed.state_dict[n])\n"
        "                for n in packed.state_dict if qconfig.spec_for(n, packed.state_dict[n]) is not None)\n"
        "rows_t = [json.loads(l) for l in (run / 'teacher' / 'targets.jsonl').read_text().splitlines()[:8]]\n"
        "batches = [torch.tensor([r['prompt_ids'] + r['continuation_ids']]) for r in rows_t]\n"
        "distilled = AutoModelForCausalLM.from_pretrained(run / 'train' / 'best_distill', dtype=torch.float32).eval()\n"
        "agree = {'QAT latent fp vs packed': pack.logit_agreement(lambda x: model(x).logits, lambda x: fq(x).logits,\n"
        "                                                        batches),\n"
        "         'distilled fp vs packed': pack.logit_agreement(lambda x: distilled(x).logits,\n"
        "                                                       lambda x: fq(x).logits, batches)}\n"
        "engine = DraftEngine(out, dtype='float32', copy_policy={'enabled': False})\n"
        "draft_match = []\n"
        "for r in rows_t[:4]:\n"
        "    ctx = r['prompt_ids']\n"
        "    want = speculative_generate(fq, ctx, 8).tokens  # plain greedy, no stop tokens (the engine has none)\n"
        "    draft_match.append(engine.draft(ctx, 8) == want)\n"
        "report = {'packed_equals_fake_quant': exact, 'engine_drafts_match_fake_quant': draft_match,\n"
        "          'sizes': sizes, 'fp32_bytes': fp_bytes, 'logit_agreement': agree,\n"
        "          'weight_error_mean': float(err.rel_error.mean())}\n"
        "(run / 'pack_report.json').write_text(json.dumps(report, indent=2))\n"
        "display(Image(str(pack.plot_logit_agreement(agree, run / 'plots' / 'logit_agreement.png'))))\n"
        "assert exact, 'packed weights differ from the fake-quant weights'\n"
        "report",
        "if publish:\n"
        "    dest = Path(publish_dir) if publish_dir else study.REPO_ROOT / 'model'\n"
        "    dest.mkdir(parents=True, exist_ok=True)\n"
        "    for f in Path(out).iterdir():\n"
        "        shutil.copy2(f, dest / f.name)\n"
        "    read_model_dir(dest)\n"
        "    print(f'published {out} -> {dest}')",
    ],
    "05_eval": [
        new_markdown_cell("# 05 - Evaluation\nHeld-out prompts -> target greedy references -> greedy-verification "
                          "simulation for every baseline (mean acceptance length incl. bonus token, per-position "
                          "acceptance, accepted-length histogram, per category), then real speculative decoding "
                          "with the packed drafter: lossless check and wall-clock speedup."),
        _params('num_threads', 'teacher', 'drafter_base', 'keep_layers', 'device', 'eval_limit',
                'eval_max_new_tokens', 'k', 'e2e_prompts', 'e2e_k', 'group_by'),
        COMMON + "from drafter_lib import evaluate as ev, hf_models, study\n\n"
                 "study.init_notebook(num_threads)\nrun = Path(run_dir)\n"
                 "teacher_spec = study.resolve_model(teacher, run)\n"
                 "records = ev.load_eval_prompts(run / 'data' / 'heldout.jsonl', eval_limit)\n"
                 "target, tok = hf_models.load_teacher(teacher_spec, device=device)\n"
                 "base_model, _ = hf_models.load_drafter_base(study.resolve_model(drafter_base, run, "
                 "fallback=teacher_spec))\n"
                 "if keep_layers is not None:\n"
                 "    base_model, _ = hf_models.prune_layers(base_model, keep_layers)\n"
                 "base = (ev.hf_config_dict(base_model.config), base_model.state_dict())\n"
                 "fp = ev.load_hf_checkpoint(run / 'train' / 'best_distill')\n"
                 "drafters = ev.standard_baselines(run / 'model', base=base, fp=fp)\n"
                 "metrics = ev.run_evaluation(target, tok, records, drafters, k=k,\n"
                 "                            max_new_tokens=eval_max_new_tokens,\n"
                 "                            group_by=group_by, e2e_prompts=e2e_prompts, e2e_k=e2e_k,\n"
                 "                            references_path=run / 'eval' / 'references.jsonl')\n"
                 "metrics['target'] = teacher_spec\n"
                 "ev.write_metrics(run / 'eval' / 'metrics.json', metrics)\n"
                 "ev.write_metrics(run / 'metrics.json', metrics)\n"
                 "print(ev.baselines_table(metrics['baselines'], k))",
        "pd.DataFrame({name: {'mean acceptance length': r['mean_acceptance_length'],\n"
        "                     'p(pos 1)': r['per_position_acceptance'][0], 'steps': r['steps'],\n"
        "                     **{f'MAL[{c}]': v['mean_acceptance_length'] for c, v in r['per_category'].items()}}\n"
        "              for name, r in metrics['baselines'].items()}).T",
        "for p in ev.save_plots(metrics, run / 'plots'):\n    display(Image(str(p)))",
        "e2e = metrics['end_to_end']\n"
        "print(f\"lossless: {e2e.get('lossless')}   \"\n"
        "      f\"speedup over target greedy: {e2e.get('speedup') or float('nan'):.2f}x\")\n"
        "assert e2e.get('lossless') is not False, f\"speculative output differs from greedy on prompts "
        "{e2e['mismatched_prompts']}\"\n"
        "e2e",
    ],
}


def build(out_dir: Path = HERE) -> list[Path]:
    paths = []
    for name, cells in NOTEBOOKS.items():
        nb = new_notebook()
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        for i, c in enumerate(cells):
            cell = c if not isinstance(c, str) else new_code_cell(c)
            if i == 1:
                cell.metadata["tags"] = ["parameters"]
            cell.id = f"{name}-{i}"  # stable ids: regenerating gives identical files
            nb.cells.append(cell)
        path = out_dir / f"{name}.ipynb"
        nbformat.write(nb, str(path))
        paths.append(path)
    return paths


if __name__ == "__main__":
    for p in build():
        print(p)
