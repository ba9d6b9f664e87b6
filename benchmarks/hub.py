"""Models of the model libraries, where installed (an optional extra: ``pip install
transformers timm``): transformers' GPT-2, Llama, BERT, T5, ViT, ResNet and ConvNeXt and
timm's ViT, ResNet and ConvNeXt, built from configs with random weights (nothing is
downloaded), each wrapped with the loss it trains on, and timed as ``zoo.py`` times its
models: a training step (or, with ``--forward``, the loss under ``torch.no_grad``) eager,
under ``torch.compile`` and under ``plait.jit``, every gradient checked against eager's.
Dropout is off, so that the three columns compute the same step.

    .venv/bin/python benchmarks/hub.py [--models gpt2,llama,...] [--device cuda] [--forward]
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import images, main, tokens


class LossOf(nn.Module):
    """A library's model with its training loss: ``forward(*batch)`` returns the loss."""

    def __init__(self, model: nn.Module, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, *batch):
        return self.loss(self.model, *batch)


def _language_model(model: str, config: str, settings: dict, seq: int, batch: int):
    """transformers' ``model`` of ``config(**settings)``, trained on tokens that are their
    own labels (the causal models shift them; BERT predicts every token; T5 decodes them)."""
    import transformers

    def make():
        built = getattr(transformers, model)(getattr(transformers, config)(**settings))
        return LossOf(built, lambda m, ids, _: m(input_ids=ids, labels=ids).loss)

    return make, lambda device: tokens(settings["vocab_size"], batch, seq, device)


def _image_model(make_model, loss, small: bool):
    image, batch = (32, 2) if small else (224, 64)
    return (lambda: LossOf(make_model(image), loss),
            lambda device: images(image, batch, 10, device))


def _hf_images(m, x, y):
    return m(pixel_values=x, labels=y).loss


def _logits_loss(m, x, y):
    return F.cross_entropy(m(x), y)


def gpt2(small: bool):
    size = dict(n_layer=2, n_embd=64, n_head=4) if small else {}
    return _language_model("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=256 if small else 50304, n_positions=1024, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, **size), 32 if small else 1024, 2 if small else 8)


def llama(small: bool):
    size = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                num_attention_heads=4, num_key_value_heads=1) if small else dict(
        num_hidden_layers=8, hidden_size=1024, intermediate_size=4096,
        num_attention_heads=16, num_key_value_heads=4)
    return _language_model("LlamaForCausalLM", "LlamaConfig", dict(
        vocab_size=256 if small else 32000, max_position_embeddings=1024, **size),
        32 if small else 1024, 2 if small else 4)


def bert(small: bool):
    size = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                num_attention_heads=4) if small else {}
    return _language_model("BertForMaskedLM", "BertConfig", dict(
        vocab_size=256 if small else 30522, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **size), 32 if small else 512, 2 if small else 8)


def t5(small: bool):
    size = dict(num_layers=2, d_model=64, d_ff=256, d_kv=16, num_heads=4) if small else {}
    return _language_model("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=256 if small else 32128, dropout_rate=0.0, decoder_start_token_id=0,
        **size), 32 if small else 512, 2 if small else 8)


def vit(small: bool):
    import transformers

    size = dict(patch_size=8, num_hidden_layers=2, hidden_size=64, intermediate_size=256,
                num_attention_heads=4) if small else {}
    return _image_model(lambda image: transformers.ViTForImageClassification(
        transformers.ViTConfig(image_size=image, num_labels=10, **size)), _hf_images, small)


def resnet(small: bool):
    import transformers

    size = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]) if small else {}
    return _image_model(lambda image: transformers.ResNetForImageClassification(
        transformers.ResNetConfig(num_labels=10, **size)), _hf_images, small)


def convnext(small: bool):
    import transformers

    size = dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1]) if small else {}
    return _image_model(lambda image: transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(num_labels=10, **size)), _hf_images, small)


def _timm(name: str, small_kwargs: dict):
    def sizes(small: bool):
        import timm

        return _image_model(lambda image: timm.create_model(
            name, pretrained=False, num_classes=10, **(small_kwargs if small else {})),
            _logits_loss, small)

    return sizes


TRANSFORMERS = {"gpt2": gpt2, "llama": llama, "bert": bert, "t5": t5, "vit": vit,
                "resnet": resnet, "convnext": convnext}
TIMM = {"timm-vit": _timm("vit_base_patch16_224", dict(img_size=32, patch_size=8, depth=2,
                                                        embed_dim=64, num_heads=4)),
        "timm-resnet": _timm("resnet50", dict(layers=[1, 1, 1, 1])),
        "timm-convnext": _timm("convnext_tiny", dict(depths=(1, 1, 1, 1),
                                                      dims=(16, 32, 64, 128)))}
MODELS = {**(TRANSFORMERS if importlib.util.find_spec("transformers") else {}),
          **(TIMM if importlib.util.find_spec("timm") else {})}

if __name__ == "__main__":
    if not MODELS:
        raise SystemExit("hub.py needs transformers or timm: pip install transformers timm")
    main(MODELS, __doc__)
