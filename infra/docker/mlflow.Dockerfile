# MLflow tracking server with what the stack needs: Postgres driver (backend store) and boto3 (MinIO/S3 artifacts).
FROM ghcr.io/mlflow/mlflow:v3.1.0
RUN pip install --no-cache-dir psycopg2-binary boto3 "mlflow[auth]"
ENV MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1
