"""Small, randomly initialised models built from torchvision, timm and transformers code
(no downloads), with an input batch and a loss for each.

``ZOO`` maps a model name to ``(library, build)``; ``build()`` returns
``(model, make_batch, loss)`` where ``make_batch(dtype)`` draws a fresh batch and
``loss(model, batch)`` is the training loss.  ``zoo_row`` measures one row of the README
table "Supported layers and models" (``python3 -m tests.zoo.table`` prints it).
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 8


def _lm_batch(dtype):
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return ids


def _hf(config_cls: str, model_cls: str, **config):
    def build():
        transformers = importlib.import_module("transformers")
        cfg = getattr(transformers, config_cls)(**config)
        model = getattr(transformers, model_cls)(cfg)

        def loss(model, ids):
            if "T5" in model_cls:
                return model(input_ids=ids, labels=ids.flip(1)).loss
            return model(input_ids=ids, labels=ids).loss

        return model, _lm_batch, loss

    return build


def _image_batch(size=32, classes=10):
    def make(dtype):
        return torch.randn(2, 3, size, size, dtype=dtype), torch.randint(0, classes, (2,))

    return make


def _classifier_loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _vision(make_model: Callable[[], nn.Module], size=32):
    def build():
        return make_model(), _image_batch(size), _classifier_loss

    return build


def _tv_vit():
    from torchvision.models import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=10)


def _tv_swin():
    from torchvision.models import SwinTransformer

    return SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=[2, 2],
                           stochastic_depth_prob=0.0, num_classes=10)


def _tv_convnext():
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)], stochastic_depth_prob=0.0,
                    num_classes=10)


def _tv_resnet():
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def _timm_resnetv2_gn():
    from functools import partial

    from timm.layers import GroupNormAct
    from timm.models.resnetv2 import ResNetV2

    return ResNetV2(layers=[1, 1], channels=(32, 64), stem_chs=16, num_classes=10,
                    norm_layer=partial(GroupNormAct, num_groups=8))


def _timm_convnext():
    from timm.models.convnext import ConvNeXt

    return ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 16, 32), num_classes=10)


HF_SMALL = dict(vocab_size=VOCAB)
ZOO: dict[str, tuple[str, Callable]] = {
    "GPT-2": ("transformers", _hf("GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=2, n_positions=16,
                                  **HF_SMALL)),
    "BERT": ("transformers", _hf("BertConfig", "BertForMaskedLM", num_hidden_layers=2, hidden_size=32,
                                 num_attention_heads=2, intermediate_size=64, max_position_embeddings=16, **HF_SMALL)),
    "Llama": ("transformers", _hf("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=2, hidden_size=32,
                                  num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                                  max_position_embeddings=16, **HF_SMALL)),
    "T5": ("transformers", _hf("T5Config", "T5ForConditionalGeneration", num_layers=2, d_model=32, d_ff=64, d_kv=16,
                               num_heads=2, decoder_start_token_id=0, dropout_rate=0.0, **HF_SMALL)),
    "ViT": ("torchvision", _vision(_tv_vit)),
    "Swin": ("torchvision", _vision(_tv_swin)),
    "ConvNeXt (torchvision)": ("torchvision", _vision(_tv_convnext)),
    "ResNet": ("torchvision", _vision(_tv_resnet)),
    "ResNetV2-GN": ("timm", _vision(_timm_resnetv2_gn)),
    "ConvNeXt (timm)": ("timm", _vision(_timm_convnext)),
}

#: Parameters the goal leaves out: lookup tables, positional / class tokens, scales used
#: elementwise, and weights used functionally (name fragments of the parameter's own name).
NOT_LAYER_WEIGHTS = ("pos_embedding", "class_token", "cls_token", "pos_embed", "relative_position_bias_table",
                     "layer_scale", "gamma", "in_proj_weight", "in_proj_bias", "mask_token", "logit_scale")


def excluded(model: nn.Module) -> set[int]:
    """ids of the parameters outside the goal: embeddings' tables and the names above."""
    out: set[int] = set()
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            if isinstance(module, nn.Embedding) or pname in NOT_LAYER_WEIGHTS:
                out.add(id(p))
    return out


def share_preconditioned(opt, model: nn.Module) -> float:
    """The share of ``model``'s parameter elements whose F comes from factors."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if opt.fisher_view(p) is not None) / sum(p.numel() for p in params)


def zoo_row(name: str, opt_cls=None) -> dict:
    """Build the model, take one capture step, and measure what is preconditioned."""
    from lightning_cafin import AdaFisher

    opt_cls = opt_cls or AdaFisher
    _, build = ZOO[name]
    torch.manual_seed(0)
    model, make_batch, loss = build()
    model = model.double().train()
    opt = opt_cls(model, backend="foreach", TCov=1)
    opt.zero_grad()
    loss(model, make_batch(torch.float64)).backward()
    opt.step()
    params = list(model.parameters())
    skip = excluded(model)
    modules = dict(model.named_modules())
    for layer in opt.unseen_layers:  # used functionally: outside the goal as well
        skip |= {id(p) for p in modules[layer].parameters(recurse=False)}
    pre = [p for p in params if opt.fisher_view(p) is not None]
    eligible = sum(p.numel() for p in params if id(p) not in skip)
    pre_eligible = sum(p.numel() for p in pre if id(p) not in skip)
    f_one_types = sorted({type(m).__name__ for m in model.modules()
                          for p in m.parameters(recurse=False) if opt.fisher_view(p) is None})
    return {
        "model": name, "library": ZOO[name][0], "share": share_preconditioned(opt, model), "share_of_layers": pre_eligible / eligible,
        "f_one": f_one_types, "summary": opt.summary(), "opt": opt, "model_obj": model,
    }


def built_for_comparison(name: str):
    """``(model, make_batch, loss)`` of zoo model ``name`` in train mode with dropout off (eager and
    compiled runs draw different dropout masks); skips when its library is not installed."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(ZOO[name][0]) is None:
        pytest.skip(f"{ZOO[name][0]} is not installed (pip install -e .[zoo])")
    torch.manual_seed(0)
    base, make_batch, loss = ZOO[name][1]()
    base.train()
    for m in base.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return base, make_batch, loss
