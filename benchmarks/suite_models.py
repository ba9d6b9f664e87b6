"""The model suite's models: the lists torch.compile's own benchmark harness runs
(transformers' and timm's) and torchvision's classics, each built offline from its
library's config or constructor with random weights, at the harness's size (``full``) or at
a tiny size for the CPU (``tiny``: two layers, narrow widths, small images and sequences).

``SUITE`` maps a name to a ``Model``: ``build(tiny)`` returns an ``nn.Module`` whose
forward takes keyword arguments (labels included) and returns ``(result, loss)`` (the
logits, and the loss the model trains on), ``inputs(module, batch, tiny, device,
generator)`` makes those arguments, and ``batch`` is the harness's batch size
(``tiny_batch`` the CPU's).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch


def import_torchvision():
    """torchvision, or a pure-Python torchvision where its native extension does not load.

    PyPI's torchvision is built against CUDA torch; beside torch's CPU build its extension
    fails to load and the import dies registering fake kernels for ``torchvision::nms``,
    an operator that then does not exist (and transformers and timm import torchvision).
    Its models are pure Python: defining the two operators' schemas lets the import finish,
    and only the detection ops that need the extension stay unusable."""
    try:
        import torchvision
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
        for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        library = torch.library.Library("torchvision", "DEF")
        for op in ("nms", "qnms"):
            library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        import_torchvision.library = library  # the definitions live as long as it does
        import torchvision
    return torchvision


@dataclass(frozen=True)
class Model:
    source: str  # "transformers", "timm" or "torchvision"
    build: Callable  # (tiny: bool) -> nn.Module
    inputs: Callable  # (module, batch, tiny, device, generator) -> dict of keyword arguments
    batch: int  # the harness's batch size on a GPU
    # on the CPU: 4 images (BatchNorm over 2 examples of a 2x2 map is nearly degenerate: its
    # gradients are ill-conditioned, and eager's own error is no yardstick there)
    tiny_batch: int = 2


# ---------------------------------------------------------------------------------------
# transformers: built from config classes (random weights; nothing is downloaded)
# ---------------------------------------------------------------------------------------
# Attribute names configs use for depth, width and heads, and a tiny value for each. A
# config is built again with those of its defaults' attributes, so that what its __init__
# derives from them (layer type lists, head dims) follows.
_TINY_CONFIG = dict(
    num_hidden_layers=2, n_layer=2, num_layers=2, encoder_layers=2, decoder_layers=2,
    num_decoder_layers=2, hidden_size=64, n_embd=64, d_model=64, embedding_size=64,
    intermediate_size=128, d_ff=128, d_inner=128, encoder_ffn_dim=128, decoder_ffn_dim=128,
    ffn_dim=128, num_attention_heads=4, n_head=4, num_heads=4, encoder_attention_heads=4,
    decoder_attention_heads=4, num_key_value_heads=2, head_dim=16, d_kv=16, d_head=16,
    num_local_experts=4, num_experts_per_tok=2, vocab_size=512, max_source_positions=32)

# Model-specific tiny settings on top of those (a config whose parts must agree)
_TINY_EXTRA = {
    "MobileBert": dict(embedding_size=32, intra_bottleneck_size=32, true_hidden_size=32,
                       num_feedforward_networks=1),
    "Longformer": dict(attention_window=16),
    "Whisper": dict(vocab_size=51865, num_mel_bins=16),  # its special tokens' ids are large
    "GPTJ": dict(rotary_dim=8),
    "GPTNeo": dict(attention_types=[[["global", "local"], 1]]),
}

_SEQUENCE = {"Blenderbot": 128, "GPT2": 1024, "Bart": 1024, "T5": 1024, "PLBart": 1024,
             "MBart": 1024, "Longformer": 1024, "OPT": 2048, "Albert": 512, "Deberta": 512,
             "Layout": 512, "Electra": 512, "XLNet": 512, "MegatronBert": 512, "Bert": 512,
             "Roberta": 512, "FNet": 512, "ConvBert": 512, "TrOCR": 256,
             "MobileBert": 128, "Llama": 1024, "Gemma": 1024, "Qwen": 1024, "Mistral": 1024,
             "GptOss": 1024}


def _sequence(cls_name: str, tiny: bool) -> int:
    if tiny:
        return 32
    return next((n for prefix, n in _SEQUENCE.items() if cls_name.startswith(prefix)), 128)


def _transformers():
    import_torchvision()  # first: transformers imports it where installed
    import transformers

    return transformers


def _hf_config(cls_name: str, settings: dict, tiny: bool):
    config_cls = getattr(_transformers(), cls_name).config_class
    config = config_cls(**settings)
    if tiny:
        extra = next((v for k, v in _TINY_EXTRA.items() if cls_name.startswith(k)), {})
        tiny_settings = {k: v for k, v in _TINY_CONFIG.items() if hasattr(config, k)}
        config = config_cls(**{**settings, **tiny_settings, **extra})
    config.use_cache = False
    if getattr(config, "pad_token_id", None) is None:  # batches of more than one example
        config.pad_token_id = 0
    return config


def _hf(cls_name: str, batch: int, **settings) -> Model:
    """transformers' ``cls_name`` from its config class with ``settings``, trained on random
    tokens with the labels its head takes, as the harness makes them."""

    def build(tiny: bool):
        return Task(getattr(_transformers(), cls_name)(_hf_config(cls_name, settings, tiny)))

    def inputs(task, batch, tiny, device, generator):
        config, seq = task.model.config, _sequence(cls_name, tiny)

        def tokens(high, *shape):
            return torch.randint(0, high, shape, generator=generator).to(device)

        vocab = config.vocab_size
        if cls_name.startswith("Whisper"):
            frames = 2 * config.max_source_positions
            features = torch.randn(batch, config.num_mel_bins, frames, generator=generator)
            return dict(input_features=features.to(device),
                        decoder_input_ids=tokens(vocab, batch, seq),
                        labels=tokens(vocab, batch, seq))
        ids = tokens(vocab, batch, seq)
        if "Bart" in cls_name and config.eos_token_id is not None:
            ids[:, -1] = config.eos_token_id
        args = dict(input_ids=ids)
        if cls_name.startswith(("T5", "MT5", "M2M100")):
            args["decoder_input_ids"] = ids
        if cls_name.endswith("QuestionAnswering"):
            args.update(start_positions=tokens(seq, batch), end_positions=tokens(seq, batch))
        elif cls_name.endswith("SequenceClassification"):
            args["labels"] = tokens(config.num_labels, batch)
        else:
            args["labels"] = tokens(vocab, batch, seq)
        return args

    return Model("transformers", build, inputs, batch)


class Task(torch.nn.Module):
    """A transformers model as the suite runs it: ``forward(**inputs)`` returns its logits
    (a question-answering head's start logits) and its loss."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs)
        logits = getattr(out, "logits", None)
        return (out.start_logits if logits is None else logits), out.loss


def _llama_1b():
    return dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                tie_word_embeddings=True, rope_theta=500000.0)


TRANSFORMERS = {
    "AlbertForMaskedLM": _hf("AlbertForMaskedLM", 8),
    "AlbertForQuestionAnswering": _hf("AlbertForQuestionAnswering", 8),
    "AllenaiLongformerBase": _hf("LongformerForMaskedLM", 8),
    "BartForCausalLM": _hf("BartForCausalLM", 8),
    "BartForConditionalGeneration": _hf("BartForConditionalGeneration", 4),
    "BertForMaskedLM": _hf("BertForMaskedLM", 32),
    "BertForQuestionAnswering": _hf("BertForQuestionAnswering", 32),
    "BlenderbotForCausalLM": _hf("BlenderbotForCausalLM", 32),
    "BlenderbotForConditionalGeneration": _hf("BlenderbotForConditionalGeneration", 16),
    "BlenderbotSmallForCausalLM": _hf("BlenderbotSmallForCausalLM", 256),
    "BlenderbotSmallForConditionalGeneration":
        _hf("BlenderbotSmallForConditionalGeneration", 128),
    "CamemBert": _hf("CamembertForMaskedLM", 32),
    "DebertaV2ForMaskedLM": _hf("DebertaV2ForMaskedLM", 8),
    "DebertaV2ForQuestionAnswering": _hf("DebertaV2ForQuestionAnswering", 8),
    "DistilBertForMaskedLM": _hf("DistilBertForMaskedLM", 256),
    "DistilBertForQuestionAnswering": _hf("DistilBertForQuestionAnswering", 512),
    "DistillGPT2": _hf("GPT2LMHeadModel", 32, n_layer=6),
    "ElectraForCausalLM": _hf("ElectraForCausalLM", 64, is_decoder=True),
    "ElectraForQuestionAnswering": _hf("ElectraForQuestionAnswering", 128),
    "GPT2ForSequenceClassification": _hf("GPT2ForSequenceClassification", 8),
    "GPTJForCausalLM": _hf("GPTJForCausalLM", 1),
    "GPTJForQuestionAnswering": _hf("GPTJForQuestionAnswering", 1),
    "GPTNeoForCausalLM": _hf("GPTNeoForCausalLM", 32),
    "GPTNeoForSequenceClassification": _hf("GPTNeoForSequenceClassification", 32),
    "GoogleFnet": _hf("FNetForMaskedLM", 32),
    "LayoutLMForMaskedLM": _hf("LayoutLMForMaskedLM", 32),
    "LayoutLMForSequenceClassification": _hf("LayoutLMForSequenceClassification", 32),
    "M2M100ForConditionalGeneration": _hf("M2M100ForConditionalGeneration", 64),
    "MBartForCausalLM": _hf("MBartForCausalLM", 8),
    "MBartForConditionalGeneration": _hf("MBartForConditionalGeneration", 4),
    "MT5ForConditionalGeneration": _hf("MT5ForConditionalGeneration", 32),
    "MegatronBertForCausalLM": _hf("MegatronBertForCausalLM", 16, is_decoder=True),
    "MegatronBertForQuestionAnswering": _hf("MegatronBertForQuestionAnswering", 16),
    "MobileBertForMaskedLM": _hf("MobileBertForMaskedLM", 256),
    "MobileBertForQuestionAnswering": _hf("MobileBertForQuestionAnswering", 256),
    "OPTForCausalLM": _hf("OPTForCausalLM", 4),
    "PLBartForCausalLM": _hf("PLBartForCausalLM", 16),
    "PLBartForConditionalGeneration": _hf("PLBartForConditionalGeneration", 8),
    "PegasusForCausalLM": _hf("PegasusForCausalLM", 128),
    "PegasusForConditionalGeneration": _hf("PegasusForConditionalGeneration", 64),
    "RobertaForCausalLM": _hf("RobertaForCausalLM", 32, is_decoder=True),
    "RobertaForQuestionAnswering": _hf("RobertaForQuestionAnswering", 32),
    "T5ForConditionalGeneration": _hf("T5ForConditionalGeneration", 8),
    "T5Small": _hf("T5ForConditionalGeneration", 8, d_model=512, d_ff=2048, num_layers=6,
                   num_heads=8),
    "TrOCRForCausalLM": _hf("TrOCRForCausalLM", 64),
    "XGLMForCausalLM": _hf("XGLMForCausalLM", 32),
    "XLNetLMHeadModel": _hf("XLNetLMHeadModel", 16),
    "YituTechConvBert": _hf("ConvBertForMaskedLM", 32),
    "meta-llama/Llama-3.2-1B": _hf("LlamaForCausalLM", 8, **_llama_1b()),
    "google/gemma-2-2b": _hf("Gemma2ForCausalLM", 8),
    "google/gemma-3-4b-it": _hf("Gemma3ForCausalLM", 8, hidden_size=2560,
                                intermediate_size=10240, num_hidden_layers=34,
                                num_attention_heads=8, num_key_value_heads=4, head_dim=256),
    "openai/whisper-tiny": _hf("WhisperForConditionalGeneration", 8, d_model=384,
                               encoder_layers=4, decoder_layers=4, encoder_attention_heads=6,
                               decoder_attention_heads=6, encoder_ffn_dim=1536,
                               decoder_ffn_dim=1536),
    "Qwen/Qwen3-0.6B": _hf("Qwen3ForCausalLM", 8, hidden_size=1024, intermediate_size=3072,
                           num_hidden_layers=28, num_attention_heads=16,
                           num_key_value_heads=8, head_dim=128, vocab_size=151936,
                           tie_word_embeddings=True),
    "mistralai/Mistral-7B-Instruct-v0.3": _hf("MistralForCausalLM", 8, vocab_size=32768),
    "openai/gpt-oss-20b": _hf("GptOssForCausalLM", 8),
}


# ---------------------------------------------------------------------------------------
# timm and torchvision: image classifiers trained with cross-entropy on random labels
# ---------------------------------------------------------------------------------------
def _images(image: int, tiny_image: int, classes: int = 10):
    def inputs(module, batch, tiny, device, generator):
        size = tiny_image if tiny else image
        return dict(x=torch.randn(batch, 3, size, size, generator=generator).to(device),
                    labels=torch.randint(0, classes, (batch,), generator=generator).to(device))

    return inputs


class Classifier(torch.nn.Module):
    """An image classifier with its training loss: ``forward(x, labels)`` returns the
    logits and the cross-entropy."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        logits = self.model(x)
        return logits, torch.nn.functional.cross_entropy(logits, labels)


def _classifier(source: str, make: Callable, batch: int, image: int, tiny_image: int) -> Model:
    return Model(source, lambda tiny: Classifier(make(tiny)), _images(image, tiny_image), batch,
                 tiny_batch=4)


def _timm(name: str, batch: int, tiny: dict, image: int = 224, tiny_image: int = 64) -> Model:
    def make(is_tiny: bool):
        import_torchvision()
        import timm

        return timm.create_model(name, pretrained=False, num_classes=10,
                                 **(tiny if is_tiny else {}))

    return _classifier("timm", make, batch, image, tiny_image)


_VIT_TINY = dict(img_size=64, depth=2, embed_dim=64, num_heads=4)
TIMM = {
    "adv_inception_v3": _timm("inception_v3", 128, {}, 299, 96),
    "beit_base_patch16_224": _timm("beit_base_patch16_224", 128, _VIT_TINY),
    "convnextv2_nano.fcmae_ft_in22k_in1k": _timm(
        "convnextv2_nano.fcmae_ft_in22k_in1k", 128, dict(depths=(1, 1, 1, 1))),
    "deit_base_distilled_patch16_224": _timm("deit_base_distilled_patch16_224", 128,
                                             _VIT_TINY),
    "deit_tiny_patch16_224.fb_in1k": _timm("deit_tiny_patch16_224.fb_in1k", 128, _VIT_TINY),
    "dm_nfnet_f0": _timm("dm_nfnet_f0", 128, {}),
    "ghostnet_100": _timm("ghostnet_100", 512, {}),
    "inception_v3": _timm("inception_v3", 128, {}, 299, 96),
    "mobilenetv2_100": _timm("mobilenetv2_100", 128, {}),
    "mobilenetv3_large_100": _timm("mobilenetv3_large_100", 512, {}),
    "mobilevit_s": _timm("mobilevit_s", 128, {}, 256),
    "nfnet_l0": _timm("nfnet_l0", 128, {}),
    "repvgg_a2": _timm("repvgg_a2", 128, {}),
    "swin_base_patch4_window7_224": _timm("swin_base_patch4_window7_224", 128, dict(
        img_size=64, depths=(2, 2), num_heads=(2, 4), embed_dim=32, window_size=4)),
    "tf_efficientnet_b0": _timm("tf_efficientnet_b0", 128, {}),
    "visformer_small": _timm("visformer_small", 128, dict(img_size=64)),
    "vit_base_patch14_dinov2.lvd142m": _timm("vit_base_patch14_dinov2.lvd142m", 128,
                                             dict(_VIT_TINY, img_size=56), 518, 56),
    "vit_base_patch16_siglip_256": _timm("vit_base_patch16_siglip_256", 128, _VIT_TINY, 256),
}


def _torchvision(name: str, batch: int, tiny: dict | Callable, image: int = 224,
                 tiny_image: int = 64) -> Model:
    def make(is_tiny: bool):
        models = import_torchvision().models
        if is_tiny and callable(tiny):
            return tiny(models)
        return getattr(models, name)(num_classes=10, **(tiny if is_tiny else {}))

    return _classifier("torchvision", make, batch, image, tiny_image)


TORCHVISION = {
    "tv_resnet50": _torchvision("resnet50", 64, {}),
    "tv_mobilenet_v3_large": _torchvision("mobilenet_v3_large", 64, {}),
    "tv_efficientnet_b0": _torchvision("efficientnet_b0", 64, {}),
    "tv_convnext_tiny": _torchvision("convnext_tiny", 64, {}),
    "tv_vit_b_16": _torchvision("vit_b_16", 64, lambda models: models.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=4, hidden_dim=64, mlp_dim=128,
        num_classes=10)),
    "tv_swin_t": _torchvision("swin_t", 64, lambda models: models.SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        num_classes=10)),
    "tv_densenet121": _torchvision("densenet121", 64, {}),
    "tv_regnet_y_400mf": _torchvision("regnet_y_400mf", 64, {}),
}

# The models users train most, at the sizes they train them, beside the harness's lists
POPULAR = {
    "GPT2LMHeadModel": _hf("GPT2LMHeadModel", 8),
    "Llama-12x768": _hf("LlamaForCausalLM", 8, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                        vocab_size=32000),
    "timm_resnet50": _timm("resnet50", 64, dict(layers=[1, 1, 1, 1])),
    "timm_vit_base_patch16_224": _timm("vit_base_patch16_224", 64, _VIT_TINY),
    "timm_convnext_tiny": _timm("convnext_tiny", 64, dict(depths=(1, 1, 1, 1))),
}

SUITE = {**TRANSFORMERS, **TIMM, **TORCHVISION, **POPULAR}
