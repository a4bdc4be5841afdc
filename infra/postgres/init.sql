-- Prefect uses the default database; MLflow gets its own.
CREATE DATABASE mlflow;
