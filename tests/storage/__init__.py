"""Stores: POSIX, S3 (moto), Azure (Azurite), GCS, plug-ins."""
