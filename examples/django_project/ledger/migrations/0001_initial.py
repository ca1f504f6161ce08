from typing import Any

from django.db import migrations, models


def create_fence_sequence(apps: Any, schema_editor: Any) -> None:
    # Transaction-scoped locks take their fencing tokens from this sequence (PostgreSQL only).
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute("CREATE SEQUENCE IF NOT EXISTS lockaspect_fence AS BIGINT")


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Account",
            fields=[
                ("name", models.CharField(max_length=64, primary_key=True, serialize=False)),
                ("balance", models.BigIntegerField(default=0)),
                ("fence", models.BigIntegerField(default=0)),
            ],
        ),
        migrations.CreateModel(
            name="Invoice",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("series", models.CharField(max_length=16)),
                ("number", models.PositiveIntegerField()),
                ("amount", models.BigIntegerField()),
            ],
            options={
                "constraints": [models.UniqueConstraint(fields=("series", "number"), name="unique_invoice_number")]
            },
        ),
        migrations.RunPython(create_fence_sequence, migrations.RunPython.noop),
    ]
