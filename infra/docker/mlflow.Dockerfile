# MLflow tracking server with what the stack needs: Postgres driver (backend store) and boto3 (MinIO/S3 artifacts).
# The server's version is the lock's client version (constraints.txt: mlflow==3.17.2): one stack, one version.
FROM ghcr.io/mlflow/mlflow:v3.17.2
COPY constraints.txt /tmp/constraints.txt
RUN pip install --no-cache-dir -c /tmp/constraints.txt "mlflow[auth]==3.17.2" psycopg2-binary boto3
ENV MLFLOW_DISABLE_TELEMETRY=true DO_NOT_TRACK=1
