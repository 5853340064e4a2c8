"""The committed GGUF files of every stored type (tests/data/gguf, made by llama.cpp's llama-quantize
through recipes/make_test_gguf.py): each opens, holds the tensor types its manifest (and README)
lists, and dequantizes with the gguf package; transformers runs one."""
import hashlib

import numpy as np
import pytest
import torch

from gguf_util import GGUF_FILES_DIR, gguf_file, gguf_files_manifest, tensor_types

MANIFEST = gguf_files_manifest()
FILES = list(MANIFEST["files"])
# What the issue asks for: every type the runtime keeps as stored is in some file.
STORED_TYPES = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}


def test_every_stored_type_is_covered_and_listed():
    found = {t for f in MANIFEST["files"].values() for t in f["tensors"].values()}
    assert found == STORED_TYPES
    readme = (GGUF_FILES_DIR / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in FILES)
    assert sorted(p.name for p in GGUF_FILES_DIR.glob("*.gguf")) == sorted(FILES)
    # Both head forms: tied (no output.weight) and untied.
    assert {"output.weight" in f["tensors"] for f in MANIFEST["files"].values()} == {True, False}


@pytest.mark.parametrize("name", FILES)
def test_file_holds_its_listed_types(name):
    path = gguf_file(name)
    entry = MANIFEST["files"][name]
    assert path.stat().st_size == entry["bytes"]
    assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"]
    assert tensor_types(path) == entry["tensors"]
    ftype = entry["ftype"]  # the file's own type is its matrices' main one
    main = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}.get(ftype, ftype)
    assert sum(t == main for t in entry["tensors"].values()) >= 12


@pytest.mark.parametrize("name", FILES)
def test_every_tensor_dequantizes(name):
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(gguf_file(name)))
    model = MANIFEST["models"][MANIFEST["files"][name]["model"]]
    assert reader.fields["llama.embedding_length"].contents() == model["hidden"]
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        assert values.dtype == np.float32
        assert values.shape == tuple(int(n) for n in reversed(t.shape)), t.name
        assert np.isfinite(values).all(), t.name
        std = float(values.std())
        # Random normal weights (std 0.05-0.1) and norm weights in [0.8, 1.2], as the recipe wrote them.
        assert (0.03 < std < 0.15) if values.ndim == 2 else (0.8 <= values.min() and values.max() <= 1.2), t.name


def test_transformers_runs_a_q4_k_m_file():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = "tiny-llama.Q4_K_M.gguf"
    tok = AutoTokenizer.from_pretrained(GGUF_FILES_DIR, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(GGUF_FILES_DIR, gguf_file=name, dtype=torch.float32).eval()
    ids = tok(MANIFEST["prompt"], return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == MANIFEST["prompt"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], MANIFEST["models"]["tiny-llama"]["vocab"])
    assert torch.isfinite(logits).all() and logits.std() > 0.1
