# SPDX-License-Identifier: Apache-2.0
"""HF's MuseGlimmer text model as a causal LM, the reference for the tiny
``muse_glimmer`` checkpoint (``MuseGlimmerForCausalLM``, text only).

transformers has MuseGlimmer's text model (``MuseGlimmerTextModel``) but runs
it only inside ``MuseGlimmerForConditionalGeneration``, with a vision tower.
This puts an LM head on HF's text model in the released weight names
(``model.language_model.*``, ``lm_head``), and computes the logits as HF's
``MuseGlimmerForConditionalGeneration.forward`` does: times
``output_multiplier``, then ``final_logit_softcapping * tanh(logits /
final_logit_softcapping)``. The decoder layers, norms, rotary and attention
are HF's own modules. Registered with ``AutoModelForCausalLM`` for HF's
``MuseGlimmerTextConfig``. Written for the tests, not from vLLM.
"""

import torch
from torch import nn
from transformers import AutoModelForCausalLM, MuseGlimmerTextConfig
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.models.muse_glimmer.modeling_muse_glimmer import (
    MuseGlimmerPreTrainedModel,
    MuseGlimmerTextModel,
)


class _Body(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = MuseGlimmerTextModel(config)


class MuseGlimmerTextReferenceForCausalLM(MuseGlimmerPreTrainedModel):
    config_class = MuseGlimmerTextConfig

    def __init__(self, config):
        super().__init__(config)
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.language_model.embed_tokens

    def forward(self, input_ids=None, **kwargs):
        out = self.model.language_model(input_ids=input_ids, **kwargs)
        logits = self.lm_head(out.last_hidden_state) * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
        return CausalLMOutputWithPast(
            logits=logits, hidden_states=out.hidden_states, attentions=out.attentions
        )


AutoModelForCausalLM.register(
    MuseGlimmerTextConfig, MuseGlimmerTextReferenceForCausalLM, exist_ok=True
)
