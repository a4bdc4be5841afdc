# GPU worker: CUDA runtime, CUDA torch and the `gpu` extra (vLLM), bubblewrap for the code sandbox.
#   docker build -f infra/docker/worker-gpu.Dockerfile -t grpoflow-worker-gpu .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
      build-essential bubblewrap git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY . /app
# vLLM pins the CUDA torch it was built against; let it choose (no CPU constraint here).
RUN pip install --no-cache-dir -e ".[gpu]" boto3 deepspeed
ENV GRPOFLOW_HOME=/app PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1
