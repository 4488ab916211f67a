"""The batch crop-and-flip: each output is a window of the padded image, mirrored about half the time."""

import pytest
import torch
import torch.nn.functional as F

from lightning_cafin.data.augment import normalize, random_crop_flip


def _source_of(out, image, padding):
    """(dy, dx, mirrored) of the window of the padded ``image`` that ``out`` is, or None."""
    padded = F.pad(image, (padding,) * 4)
    h, w = image.shape[-2:]
    for dy in range(2 * padding + 1):
        for dx in range(2 * padding + 1):
            window = padded[:, dy : dy + h, dx : dx + w]
            if torch.equal(window, out):
                return dy, dx, False
            if torch.equal(window.flip(-1), out):
                return dy, dx, True
    return None


def test_every_output_is_a_window_of_its_own_padded_image():
    x = torch.rand(64, 3, 8, 8) + 0.1
    g = torch.Generator().manual_seed(0)
    y = random_crop_flip(x, padding=2, generator=g)
    assert y.shape == x.shape and y.is_contiguous()
    sources = [_source_of(y[i], x[i], 2) for i in range(len(x))]
    assert all(s is not None for s in sources)
    offsets = {s[:2] for s in sources}
    flips = sum(s[2] for s in sources)
    assert len(offsets) > 5, "offsets should vary across the batch"
    assert 16 <= flips <= 48, f"{flips} of 64 mirrored"


def test_channels_stay_together_and_no_padding_no_flip_is_identity():
    x = torch.rand(4, 3, 5, 7)
    assert torch.equal(random_crop_flip(x, padding=0, flip=False), x)
    y = random_crop_flip(x, padding=1)
    for i in range(4):
        assert _source_of(y[i], x[i], 1) is not None  # one offset for all three channels


def test_bad_input():
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        random_crop_flip(torch.rand(3, 8, 8))
    with pytest.raises(ValueError, match="padding"):
        random_crop_flip(torch.rand(1, 3, 8, 8), padding=-1)


def test_normalize_per_channel():
    x = torch.rand(2, 3, 4, 4)
    y = normalize(x, (0.1, 0.2, 0.3), (0.5, 1.0, 2.0))
    assert torch.allclose(y[:, 2], (x[:, 2] - 0.3) / 2.0)


@pytest.mark.cuda
def test_on_the_gpu_offsets_are_drawn_there_and_windows_are_right():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.rand(32, 3, 8, 8, device="cuda") + 0.1
    y = random_crop_flip(x, padding=2)
    assert y.device == x.device
    assert all(_source_of(y[i].cpu(), x[i].cpu(), 2) is not None for i in range(len(x)))
