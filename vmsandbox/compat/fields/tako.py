"""Tako's GPU settings, as ``tako-vm`` 0.3.0 reads a job type's ``gpu`` (its config model and
``from_dict``) and a whole job type (``from_dict``, legacy ``gpu_*`` fields included)."""

from __future__ import annotations

from vmsandbox.compat.fields.model import A, Row, examples

ROWS: tuple[Row, ...] = (
    # --- Tako: both readers ---
    Row(
        "tako",
        "`enabled`",
        'the config model reads a bool (also 0/1 and words such as "yes", "false"); '
        '`from_dict` reads `bool(value)`, so "false" is true there',
        'taken where both readers agree; `null` and "false"-like strings refused',
        examples(
            "tako",
            (
                {"enabled": "yes", "vendor": "nvidia"},
                "config: every nvidia GPU; from_dict: every nvidia GPU",
                "every nvidia GPU",
            ),
            (
                {"enabled": "false", "vendor": "nvidia"},
                "config: refused; from_dict: every nvidia GPU",
                "refused (gpu.enabled)",
            ),
        ),
    ),
    Row(
        "tako",
        "`vendor`",
        'required when enabled: "nvidia" or "amd" after trimming and lower-casing',
        "the same",
        examples(
            "tako",
            (
                {"enabled": True, "vendor": " AMD "},
                "config: every amd GPU; from_dict: every amd GPU",
                "every amd GPU",
            ),
            ({"enabled": True}, "config: refused; from_dict: refused", "refused (gpu.vendor)"),
        ),
    ),
    Row(
        "tako",
        "`count`",
        'an integer as pydantic reads it (`2`, `"2"`, `2.0`), 1 to 16, NVIDIA only',
        "the same, also for AMD",
        examples(
            "tako",
            (
                {"enabled": True, "vendor": "nvidia", "count": "2"},
                "config: 2 nvidia GPUs; from_dict: 2 nvidia GPUs",
                "2 nvidia GPUs",
            ),
            (
                {"enabled": True, "vendor": "nvidia", "count": 17},
                "config: refused; from_dict: refused",
                "refused (gpu.count)",
            ),
        ),
    ),
    Row(
        "tako",
        "`count` with vendor amd",
        "refused: only NVIDIA takes a count",
        "N AMD GPUs: a VM passes them through",
        examples(
            "tako",
            (
                {"enabled": True, "vendor": "amd", "count": 2},
                "config: refused (count is only "
                "supported for nvidia); from_dict: refused (count is only supported for nvidia)",
                "2 amd GPUs",
            ),
        ),
        differs="tako-amd-count",
    ),
    Row(
        "tako",
        "`device_ids`",
        "a list of up to 16 strings, none empty or with a comma, no repeats; `[]` means not "
        "set; `null` is refused by both readers",
        "the same",
        examples(
            "tako",
            (
                {"enabled": True, "vendor": "nvidia", "device_ids": ["41:00.0"]},
                "config: GPUs 41:00.0; from_dict: GPUs 41:00.0",
                f"1 nvidia GPU: {A}",
            ),
            (
                {"enabled": True, "vendor": "nvidia", "device_ids": None},
                "config: refused; from_dict: refused",
                "refused (gpu.device_ids)",
            ),
        ),
    ),
    Row(
        "tako",
        "device ids vmsandbox cannot resolve",
        "passed to the container runtime, which fails to start the job",
        "refused before anything is allocated",
        examples(
            "tako",
            (
                {"enabled": True, "vendor": "nvidia", "device_ids": ["gpu0"]},
                "config: GPUs gpu0; from_dict: GPUs gpu0",
                "refused (gpu.device_ids)",
            ),
        ),
        differs="tako-device-ids-resolve",
    ),
    Row(
        "tako",
        "the shipped default block",
        "no GPU",
        "no GPU",
        examples(
            "tako",
            (
                {"enabled": False, "vendor": None, "count": None, "device_ids": []},
                "config: no GPU; from_dict: no GPU",
                "no GPU",
            ),
        ),
    ),
    # --- Tako job types: from_dict ---
    Row(
        "tako_job",
        "legacy `gpu_enabled`, `gpu_vendor`, `gpu_count`, `gpu_device_ids`",
        "stand for the keys of `gpu` and win over them",
        "read the same; one that disagrees with the same key in `gpu` is refused",
        examples(
            "tako_job",
            (
                {"name": "job", "gpu_enabled": True, "gpu_vendor": "nvidia", "gpu_count": 2},
                "from_dict: 2 nvidia GPUs",
                "2 nvidia GPUs",
            ),
            (
                {
                    "name": "job",
                    "gpu_count": 1,
                    "gpu": {"enabled": True, "vendor": "nvidia", "count": 2},
                },
                "from_dict: 1 nvidia GPU",
                "refused (gpu_count)",
            ),
        ),
        differs="tako-job-flat-and-nested",
    ),
    Row(
        "tako_job",
        "`gpu_count` with vendor amd",
        "refused: only NVIDIA takes a count",
        "N AMD GPUs",
        examples(
            "tako_job",
            (
                {"name": "job", "gpu_enabled": True, "gpu_vendor": "amd", "gpu_count": 2},
                "from_dict: refused (count is only supported for nvidia)",
                "2 amd GPUs",
            ),
        ),
        differs="tako-job-amd-count",
    ),
    Row(
        "tako_job",
        "device ids vmsandbox cannot resolve",
        "passed to the container runtime",
        "refused",
        examples(
            "tako_job",
            (
                {
                    "name": "job",
                    "gpu": {"enabled": True, "vendor": "nvidia", "device_ids": ["gpu0"]},
                },
                "from_dict: GPUs gpu0",
                "refused (gpu.device_ids)",
            ),
        ),
        differs="tako-job-device-ids-resolve",
    ),
)
