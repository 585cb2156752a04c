"""The placement check itself (``mindspeed_like.testing.fake_cuda``): what it catches, what it lets
through as CUDA does, and that nothing of it outlives the block. Its use on megatron's models:
tests/integration/test_cuda_placement.py."""

from __future__ import annotations

import pytest
import torch

from mindspeed_like.testing.fake_cuda import DeviceMismatchError, fake_cuda, on_fake_cuda


def test_tensors_on_the_gpu_report_it_and_a_host_operand_is_refused():
    with fake_cuda():
        gpu = torch.ones(4, 3, device="cuda")
        moved = torch.ones(4, 3).cuda()
        assert gpu.device == torch.device("cuda", 0) and gpu.is_cuda and gpu.get_device() == 0
        assert gpu.type() == "torch.cuda.FloatTensor" and (gpu + moved).is_cuda
        assert torch.empty(2, device=torch.cuda.current_device()).is_cuda and torch.device(0).type == "cuda"
        with pytest.raises(DeviceMismatchError, match="cuda:0 and cpu"):
            gpu + torch.ones(4, 3)
        with pytest.raises(DeviceMismatchError, match="cuda:0 and cpu"):
            torch.cat([gpu, torch.ones(1, 3)])
        with pytest.raises(DeviceMismatchError, match="cuda:0 and cpu"):
            gpu.index_select(0, torch.tensor([0, 1]))  # CUDA's index_select wants its index there too
        with pytest.raises(TypeError, match="numpy"):
            gpu.numpy()
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.ones(1, device="cuda:1")  # a one-GPU host


def test_what_cuda_allows_across_devices_is_allowed():
    with fake_cuda():
        gpu = torch.arange(12.0, device="cuda").view(4, 3)
        assert (gpu * torch.tensor(2.0)).is_cuda  # a CPU 0-dim tensor is a scalar
        assert gpu[torch.tensor([0, 2])].is_cuda  # host indices
        gpu[torch.tensor([1])] = torch.zeros(3, device="cuda")
        host = gpu.cpu()
        assert not host.is_cuda and host.data_ptr() != gpu.data_ptr() and host.sum().item() == gpu.sum().item()
        assert not gpu.to("cpu").is_cuda and gpu.to(gpu) is gpu and host.to(gpu).is_cuda
        gpu.copy_(torch.zeros(4, 3))  # a host -> device copy
        host.copy_(gpu)  # and back: the destination stays on the host
        assert not on_fake_cuda(host) and host.sum().item() == 0


def test_backward_hooks_and_autograd_functions_see_the_gpu():
    seen = []

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(grad.device)
            return grad * torch.ones(grad.shape, device=grad.device)  # a GPU tensor, made from its device

    with fake_cuda():
        linear = torch.nn.Linear(3, 2).to(torch.device("cuda", 0))
        x = torch.ones(4, 3, device="cuda", requires_grad=True)
        linear(Double.apply(x)).sum().backward()
        (grad,) = torch.autograd.grad(Double.apply(x).sum(), x)
        assert linear.weight.grad.is_cuda and x.grad.is_cuda and grad.is_cuda
    assert seen == [torch.device("cuda", 0)] * 2


def test_tensors_torch_makes_inside_an_op_go_where_the_op_runs():
    """A backward formula's ``at::zeros(sizes, grad.options())`` follows the GPU computation (the
    host's options here), and a dtype change through a GPU tensor's options (``type_as``) stays on
    the GPU, where ``torch.zeros(n)`` from Python is the host's."""
    with fake_cuda():
        weight = torch.randn(5, 3, device="cuda", requires_grad=True)
        index = torch.tensor([0, 4, 4], device="cuda")
        weight.index_select(0, index).sum().backward()  # index_add into zeros made in C++
        assert weight.grad.is_cuda
        assert torch.ones(2, device="cuda").type_as(torch.ones(2, dtype=torch.bfloat16, device="cuda")).is_cuda
        assert not torch.zeros(3).is_cuda


def test_torch_cuda_answers_as_a_one_gpu_host_inside_only():
    before = torch.cuda.is_available(), torch.device, torch.cuda.current_device
    with fake_cuda():
        assert torch.cuda.is_available() and torch.cuda.device_count() == 1 and torch.cuda.current_device() == 0
        state = torch.cuda.get_rng_state()
        torch.cuda.manual_seed(7)
        torch.cuda.set_rng_state(state)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda.current_stream().wait_stream(stream)
        torch.ones(2, device="cuda").record_stream(stream)
        torch.cuda.synchronize()
        assert torch.cuda.max_memory_allocated() == 0
        with pytest.raises(RuntimeError, match="not reentrant"), fake_cuda():
            pass
    assert (torch.cuda.is_available(), torch.device, torch.cuda.current_device) == before
    assert torch.device is torch._C.device and not torch.cuda.is_available()
    with pytest.raises(RuntimeError):
        torch.ones(1, device="cuda")  # the CPU-only torch again


def test_host_round_trips_are_counted_by_kind():
    """What makes the host wait for a GPU, counted on the fake GPU's tensors only (host_round_trips)."""
    from mindspeed_like.testing.host_round_trips import count_host_round_trips

    with fake_cuda(), count_host_round_trips() as trips:
        gpu = torch.arange(6.0, device="cuda")
        host = torch.arange(6.0)
        host.sum().item(), host.tolist(), host[host > 2], host.nonzero()  # the host's own: nothing
        gpu[torch.tensor([0, 1])], gpu + 1, host.cuda(), gpu.masked_fill(gpu > 2, 0)  # no wait on CUDA
        ones = torch.ones(6, dtype=torch.long, device="cuda")
        gpu.repeat_interleave(ones, output_size=6)
        assert trips.total == 0, dict(trips.by_kind)
        gpu.sum().item(), bool(gpu.sum() > 0)
        gpu.tolist(), gpu.cpu(), torch.zeros(6).copy_(gpu)
        gpu.nonzero(), torch.where(gpu > 1)
        gpu[gpu > 2], gpu.unique(), gpu.repeat_interleave(ones)
    assert dict(trips.by_kind) == {"item": 2, "to-host": 3, "nonzero": 2, "data-dependent-shape": 3}
