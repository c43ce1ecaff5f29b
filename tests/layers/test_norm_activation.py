import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from cvllm.layers.activation import GeluAndMul, SiluAndMul, get_act_and_mul_fn
from cvllm.layers.layernorm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf(dtype):
    hf = LlamaRMSNorm(16, eps=1e-5).to(dtype)
    hf.weight.data.copy_(torch.randn(16))
    ours = RMSNorm(16, eps=1e-5, params_dtype=dtype)
    ours.weight.data.copy_(hf.weight.data)
    x, res = torch.randn(5, 16).to(dtype), torch.randn(5, 16).to(dtype)
    torch.testing.assert_close(ours(x), hf(x), rtol=0, atol=0)
    out, new_res = ours(x, res)
    torch.testing.assert_close(new_res, res + x, rtol=0, atol=0)
    torch.testing.assert_close(out, hf(res + x), rtol=0, atol=0)


def test_gated_activations():
    x = torch.randn(3, 10)
    g, u = x[:, :5], x[:, 5:]
    torch.testing.assert_close(SiluAndMul()(x), F.silu(g) * u)
    torch.testing.assert_close(GeluAndMul("tanh")(x), F.gelu(g, approximate="tanh") * u)
    torch.testing.assert_close(get_act_and_mul_fn("gelu")(x), F.gelu(g) * u)
    with pytest.raises(ValueError, match="unsupported hidden_act"):
        get_act_and_mul_fn("relu2")


def test_pair_norm_outputs_marks_norms_before_int8_linears():
    """A decoder layer's two RMSNorms learn the int8 form their next linear reads
    (``rounded_input``); a linear that takes none, a missing one, or another kind of norm
    leaves the norm as it was."""
    from torch import nn

    from cvllm.layers.layernorm import pair_norm_outputs
    from cvllm.layers.linear import ReplicatedLinear
    from cvllm.quantization.unquantized import UnquantizedLinearMethod

    class FourWords(UnquantizedLinearMethod):
        def rounded_input(self) -> int:
            return 4

    def layer(with_mlp: bool, int8: bool) -> nn.Module:
        m = nn.Module()
        m.input_layernorm, m.post_attention_layernorm = RMSNorm(64), RMSNorm(64)
        m.self_attn = nn.Module()
        m.self_attn.qkv_proj = ReplicatedLinear(64, 96, bias=False)
        if int8:
            m.self_attn.qkv_proj.quant_method = FourWords()
        if with_mlp:
            m.mlp = nn.Module()
            m.mlp.gate_up_proj = ReplicatedLinear(64, 256, bias=False)
            m.mlp.gate_up_proj.quant_method = FourWords()
        return m

    model = nn.ModuleList([layer(True, True), layer(False, True), layer(True, False)])
    model.append(nn.Module())
    model[3].input_layernorm = nn.LayerNorm(64)  # not an RMSNorm: never paired
    model[3].self_attn = nn.Module()
    model[3].self_attn.qkv_proj = model[0].self_attn.qkv_proj
    model.append(layer(True, True))
    model[4].mlp.gate_up_proj.quant_method = object()  # not a linear method (an MoE's)
    assert pair_norm_outputs(model) == 5
    assert [(m.input_layernorm.q8_wps, m.post_attention_layernorm.q8_wps)
            for m in (model[0], model[1], model[2], model[4])] == [(4, 4), (4, 0), (0, 4),
                                                                   (4, 0)]
    # the PDL site (kernels/pdl.early_trigger) names the linear found, whatever its method
    assert [(m.input_layernorm.pdl_site, m.post_attention_layernorm.pdl_site)
            for m in (model[0], model[1], model[2], model[4])] == [
        ("qkv", "mlp"), ("qkv", "norm"), ("qkv", "mlp"), ("qkv", "mlp")]
