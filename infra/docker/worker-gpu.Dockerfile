# GPU worker: the lock's CUDA torch and vLLM (the `gpu` extra = trl[vllm]), bubblewrap for the code sandbox.
#   docker build -f infra/docker/worker-gpu.Dockerfile -t grpoflow-worker-gpu .
# torch 2.13.0 from PyPI is built for CUDA 13 and brings its CUDA libraries as wheels (nvidia-*-cu13 in
# constraints.txt); the host needs an NVIDIA driver for CUDA 13. Ubuntu 24.04's Python is 3.12 (the lock is
# checked on 3.11 and 3.12: `make lock-check`).
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
      build-essential bubblewrap git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY . /app
# The same lock as `make` and the CPU image: the versions CI tests are the versions this worker runs.
# DeepSpeed (for infra/accelerate/zero*.yaml) builds from source against the installed torch.
RUN pip install --no-cache-dir -c constraints.txt -e ".[gpu]" boto3 \
    && pip install --no-cache-dir -c constraints.txt deepspeed==0.19.8
ENV GRPOFLOW_HOME=/app PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1
