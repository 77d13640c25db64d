"""Tiny test models and tokenizers shared by the test files: offline, seeded, built in milliseconds."""
import os
import tempfile

from drafter_lib.common.openmp_wait import bounded_spin

# Before torch loads: the OpenMP wait the servers the tests start set for themselves, so both sides cache their kernel
# plans under one machine key (kernels.machine_key).
bounded_spin()

import pytest  # noqa: E402
import torch  # noqa: E402

# The engine's measured kernel choice (drafter_lib/kernels.py) is cached in a directory of this session, not the
# user's ~/.cache, and without the compiled path (seconds of compiling per shape); tests that want it set it.
os.environ["SPECDRAFT_CACHE_DIR"] = tempfile.mkdtemp(prefix="specdraft-test-cache-")
os.environ["SPECDRAFT_COMPILE"] = "0"
# Targets keep torch's own linears unless a test asks (a measured choice would make their bits depend on timing).
os.environ["SPECDRAFT_TARGET_LINEARS"] = "stock"
# Nor does the engine build or time the half-rows kernel (a minute's build, and whole compiled steps timed); its
# tests set "auto".
os.environ["SPECDRAFT_HALF_ROWS"] = "0"
# The server reads its settings from plain variables (HOST, PORT, API_KEY, ...): the machine's own must not leak
# into the servers and apps the tests build; a test that wants one sets it.
for _name in __import__("drafter_lib.serve.settings", fromlist=["Settings"]).Settings.model_fields:
    for _var in (_name.upper(), _name.lower()):
        os.environ.pop(_var, None)

# The tiny Llama the quantization and packing tests share: group sizes 32/64 divide its 64/128 dims.
TINY_LLAMA = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)


def make_tiny_llama(seed: int = 0, tie: bool = True, **config):
    """A random LlamaForCausalLM (TINY_LLAMA dims, `config` overrides them) in eval mode, seeded."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": tie, **config})
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="session")
def tiny_llama():
    """Factory: tiny_llama(seed=0, tie=True, **config) -> a fresh random tiny HF Llama."""
    return make_tiny_llama


@pytest.fixture(scope="session")
def byte_tok():
    """The offline byte-level tokenizer with a ChatML template (vocab 259)."""
    from drafter_lib.model.tiny_models import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="session")
def tiny_random():
    """Factory over tiny_models.tiny_random_model with the byte tokenizer unless told otherwise: (model, tokenizer)."""
    from drafter_lib.model.tiny_models import tiny_random_model

    def make(arch: str = "llama", **kw):
        kw.setdefault("tokenizer", "bytes")
        return tiny_random_model(arch, **kw)

    return make


@pytest.fixture(scope="session")
def tiny_target():
    """(model, byte tokenizer): a tiny random Llama target for speculative-decoding and evaluation tests. Tests
    must not change its weights."""
    from drafter_lib.model.tiny_models import tiny_random_model

    return tiny_random_model("llama", tokenizer="bytes", hidden_size=32, num_hidden_layers=2, seed=3)


@pytest.fixture(scope="session")
def generation_dirs(tmp_path_factory):
    """(target folder, drafter model dir): a tiny random target as a Hugging Face folder and the same target packed
    as its drafter, for the generation tests (CLI, OpenAI-compatible server)."""
    from target_helpers import write_drafter_dir, write_target_dir

    tmp = tmp_path_factory.mktemp("generation")
    return write_target_dir(tmp / "target"), write_drafter_dir(tmp / "drafter")


@pytest.fixture(scope="session")
def generation_runtime(generation_dirs):
    """The reference: that target loaded as the server and the CLI load it (W8A8, their default)."""
    from drafter_lib.decoding.runtime import load_target_runtime

    return load_target_runtime(str(generation_dirs[0]))


@pytest.fixture(scope="session")
def smoke_run():
    """A smoke run made by the CLI at runs/<name>/ in the repository (where a notebook's run_dir points): every
    stage's notebook executed through papermill. Shared by the study and notebook tests. -> the CLI's report."""
    import shutil
    import uuid

    from drafter_lib.common.layout import RunLayout
    from drafter_lib.study import run as study

    name = f"pytest-smoke-{uuid.uuid4().hex[:8]}"
    res = study.main(["--preset", "smoke", "--name", name, "--quiet"])
    yield res
    shutil.rmtree(RunLayout.named(name).root, ignore_errors=True)
