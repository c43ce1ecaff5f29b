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
