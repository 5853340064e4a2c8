"""`specengine convert` (and the default target's conversion on first use) writes its folder with
the modes a plain write gives, as the umask says: safetensors writes through a private temporary
file, and the folder is made with mkdtemp, both 0600/0700 otherwise."""
import os
import stat

import pytest

from specengine.models import gguf as gguf_module
from specengine.models.gguf import convert_gguf
from specengine.devtools.tiny import make_config

from gguf_util import write_gguf


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_converted_files_get_the_modes_of_a_plain_write(tmp_path, tokenizer, monkeypatch, umask):
    from transformers import AutoModelForCausalLM

    config = make_config(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    write_gguf(tmp_path / "m.gguf", config, AutoModelForCausalLM.from_config(config).state_dict())
    # The tiny file has no tokenizer metadata; the conversion's own steps are what is tested.
    monkeypatch.setattr(gguf_module, "gguf_tokenizer", lambda path: tokenizer)
    old = os.umask(umask)
    try:
        out = convert_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=False)
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask
    files = [p for p in out.rglob("*") if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: oct(0o666 & ~umask) for p in files}
