"""`port init`'s distance by value (harness/port/init.py): any axis order, a frame axis a few frames
off compared over the common prefix, durations compared rounded; the end-to-end proposals on the
tiny model's split are in tests/unit/test_port_examples.py."""
from __future__ import annotations

import numpy as np
import torch

from harness.port.init import THRESHOLD, distance, nearest


def test_any_axis_order_and_size_one_axes():
    ref = torch.randn(1, 512, 40, generator=torch.Generator().manual_seed(0))
    d, note = distance(ref[0].T.numpy()[None, :, :, None], "asr", ref)  # [1, 40, 512, 1]
    assert d == 0.0 and note == ""
    assert distance(np.zeros((1, 512, 41, 3), np.float32), "asr", ref) is None  # no layout has its shape
    assert distance(np.zeros((1, 512, 40), np.int64), "asr", ref) is None  # an integer is no float tensor


def test_a_frame_longer_is_compared_over_the_common_prefix():
    ref = torch.randn(1, 80, generator=torch.Generator().manual_seed(1))  # F0_pred: [1, frames2]
    longer = torch.cat([ref, torch.randn(1, 2)], dim=1).numpy()  # one frame more (2 per frame)
    d, note = distance(longer, "F0_pred", ref)
    assert d == 0.0 and note == "; compared over the common 80 frames2: the artifact has 82, the reference 80"
    assert distance(torch.cat([ref, torch.randn(1, 10)], dim=1).numpy(), "F0_pred", ref) is None  # 5 frames: no


def test_durations_are_compared_rounded_and_the_nearest_tensor_wins():
    ref = torch.tensor([1, 3, 2, 5, 1])
    d, note = distance(np.array([[1, 3, 3, 5, 1]]), "pred_dur", ref)
    assert 0 < d < THRESHOLD and note == "; 1 of 5 durations differ (by at most 1 frame(s))"
    assert distance(np.array([1.0, 3.2, 1.9, 5.0, 1.0]), "pred_dur", ref) is None  # a float is no integer tensor
    f0, n = torch.randn(1, 30), torch.randn(1, 30)
    assert [name for _, name, _ in nearest((n * 1.001).numpy(), {"F0_pred": f0, "N_pred": n})] == ["N_pred", "F0_pred"]


def test_audio_with_its_own_noise_is_compared_by_its_envelope():
    g = torch.Generator().manual_seed(2)
    loud = torch.linspace(0.1, 1.0, 12).repeat_interleave(600)
    ref, own = loud * torch.randn(7200, generator=g), loud * torch.randn(7200, generator=g)  # two noise draws
    d, note = distance(own[None].numpy(), "audio", ref[None])
    assert d < 0.2 and note.startswith("; by its amplitude envelope (frame RMS; sample by sample 1.4"), (d, note)


def test_an_output_far_from_every_reference_stays_unknown_with_its_nearest():
    from harness.port.init import Values, output_guesses

    g = torch.Generator().manual_seed(3)
    refs = {"F0_pred": torch.randn(1, 30, generator=g), "N_pred": torch.randn(1, 30, generator=g)}
    near, far = (refs["F0_pred"] * 1.01).numpy(), torch.randn(1, 30, generator=g).numpy()
    known, unknown = output_guesses([near, far], Values("c", None, refs))
    assert known.tensor == "F0_pred" and known.why.startswith("by value: rel. L2 1.0e-02 against Kokoro's F0_pred on case c")
    assert unknown.tensor is None and unknown.why.startswith("nearest: "), unknown
    assert unknown.distance > THRESHOLD


def test_a_gain_or_a_sign_flip_still_maps_and_says_so():
    ref = torch.randn(1, 512, 20, generator=torch.Generator().manual_seed(4))
    d, note = distance((-1.5 * ref).numpy(), "asr", ref)
    assert d < 1e-6 and note == "; after a constant gain x-1.5 (as it is 2.5)", note
    assert distance(torch.randn(1, 512, 20).numpy(), "asr", ref)[0] > THRESHOLD  # unrelated: far still
