"""The same convolution stacks under whichever torch runs this script: one thread, the
CPU capability of ``ATEN_CPU_CAPABILITY`` (the benchmark's level: avx2). Run it with the
product's Python and with LeRobot's venv's to see what the torch version alone costs
(LeRobot 0.6.1 needs torch < 2.12, the product pins 2.13):

    ATEN_CPU_CAPABILITY=avx2 .venv/bin/python tools/lerobot_bench/torch_versions.py
    ATEN_CPU_CAPABILITY=avx2 tools/lerobot_bench/.venv/bin/python tools/lerobot_bench/torch_versions.py

``encoder``: a ResNet-like Conv2d stack over two 240 x 320 frames (the observation
encoder's shape); ``unet``: ten passes of a Conv1d + Mish stack at Diffusion Policy's
U-Net channels (the default 512/1024/2048 and the benchmark's small 128/256/512)."""
import statistics
import time

import torch


def median_ms(fn, runs: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(
        torch.nn.Conv2d(3, 64, 7, 2, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1),
        torch.nn.Conv2d(64, 64, 3, 1, 1), torch.nn.ReLU(), torch.nn.Conv2d(64, 64, 3, 1, 1), torch.nn.ReLU(),
        torch.nn.Conv2d(64, 128, 3, 2, 1), torch.nn.ReLU(), torch.nn.Conv2d(128, 256, 3, 2, 1), torch.nn.ReLU(),
        torch.nn.Conv2d(256, 512, 3, 2, 1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1)).eval()
    frames, trajectory = torch.randn(2, 3, 240, 320), torch.randn(1, 14, 16)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, one thread")
    with torch.inference_mode():
        print(f"encoder: {median_ms(lambda: encoder(frames)):.2f} ms")
        for dims in ((128, 256, 512), (512, 1024, 2048)):
            channels = (*dims, *reversed(dims[:-1]))
            pairs = zip((14, *channels[:-1]), channels, strict=True)
            layers = [torch.nn.Conv1d(c_in, c_out, 5, padding=2) for c_in, c_out in pairs]
            unet = torch.nn.Sequential(*[m for conv in layers for m in (conv, torch.nn.Mish())]).eval()

            def ten_passes(unet=unet) -> None:
                for _ in range(10):
                    unet(trajectory)
            print(f"unet {'/'.join(map(str, dims))}, ten passes: {median_ms(ten_passes, 15):.2f} ms")


if __name__ == "__main__":
    main()
