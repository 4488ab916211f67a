"""The optimizer's settings as run hyper-parameters."""

import torch
from torch import nn

from lightning_cafin import AdaFisherW
from lightning_cafin.monitor.hparams import optimizer_hparams
from lightning_cafin.monitor.tags import HPARAM_KEYS


def test_every_setting_with_its_value():
    model = nn.Linear(3, 2)
    opt = AdaFisherW(model, lr=torch.tensor([0.02]), beta=0.8, gamma=0.7, Lambda=2e-3, TCov=7, weight_decay=0.1,
                     backend="reference")
    hp = optimizer_hparams(opt, torch.device("cpu"), "/opt1")
    assert set(hp) == {f"cafin/{k}/opt1" for k in HPARAM_KEYS}
    assert hp["cafin/optimizer/opt1"] == "AdaFisherW" and hp["cafin/backend/opt1"] == "reference"
    assert abs(hp["cafin/lr/opt1"] - 0.02) < 1e-9 and isinstance(hp["cafin/lr/opt1"], float)
    assert (hp["cafin/beta/opt1"], hp["cafin/gamma/opt1"], hp["cafin/Lambda/opt1"]) == (0.8, 0.7, 2e-3)
    assert (hp["cafin/TCov/opt1"], hp["cafin/weight_decay/opt1"]) == (7, 0.1)
    assert hp["cafin/capture_impl/opt1"] == "torch"  # no CUDA here
