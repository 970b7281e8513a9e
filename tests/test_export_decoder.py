"""A whole decoder step as one exported program (examples/export_decoder.py):
a small Llama's forward over paged caches held as the program's globals,
the attention inside the program, one program for prefill and decode,
driven with iree.runtime: greedy tokens identical to HF eager's in
float32, for a batch and for one sequence (a batch size the export never
saw)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("iree.turbine.aot")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import export_decoder
import torch


@pytest.mark.parametrize("batch, prompt_len", [(3, 10), (1, 17)])
def test_exported_decoder_generates_hf_eager_tokens(batch, prompt_len):
    new = 8
    model = export_decoder.small_llama(seed=batch)
    program = export_decoder.export_program(model, batch * -(-(prompt_len + new) // export_decoder.PAGE))
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(7))
    ours = export_decoder.generate_exported(program, prompts.numpy(), new)
    hf = export_decoder.generate_hf(model, prompts, new).numpy()
    assert hf.shape == (batch, prompt_len + new)
    np.testing.assert_array_equal(ours, hf)
    # A random model that repeated one token would make equality cheap.
    assert len(np.unique(hf[:, prompt_len:])) > new // 2


def test_prefill_and_online_decode_functions_share_the_caches():
    """--formulation online: prefill and decode are two functions of one
    program over the same cache globals (iree-turbine's FxProgramsBuilder),
    the decode's attention the online kernel, and the prefill's too as a
    bucket of the prompt's rows: HF eager's tokens."""
    batch, prompt_len, new = 3, 10, 8
    model = export_decoder.small_llama(seed=5)
    pages = batch * -(-(prompt_len + new) // export_decoder.PAGE)
    program = export_decoder.export_program(model, pages, formulation="online", batch=batch, prompt_rows=prompt_len)
    prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(3))
    ours = export_decoder.generate_exported(program, prompts.numpy(), new)
    np.testing.assert_array_equal(ours, export_decoder.generate_hf(model, prompts, new).numpy())
