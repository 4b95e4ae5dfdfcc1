"""A chat template that renders plain ChatML, and misbehaves when the last message asks it
to: the allocations and loops that once grew a server to 12 GB or held it for seconds.

(A helper module for the template tests, beside them in tests/server.)"""

from __future__ import annotations

HOSTILE = """{% set last = messages[-1]['content'] %}
{% if last == 'center' %}{{ ' '.center(10**9) }}
{% elif last == 'width' %}{{ '{:>1000000000}'.format('x') }}
{% elif last == 'percent' %}{{ '%*s' % (1000000000, 'x') }}
{% elif last == 'namespace' %}{% set ns = namespace(items=[]) %}
{% for i in range(100000) %}{% set ns.items = ns.items + ['x' * 16000000] %}{% endfor %}
{% elif last == 'slow' %}{% for i in range(100000) %}{{ ('x' * 4000000) | replace('x', 'yy') | length }}{% endfor %}
{% elif last == 'refused' %}{{ raise_exception('roles must alternate user/assistant') }}
{% else %}{% for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] }}<|im_end|>
{% endfor %}{% endif %}"""

# the words whose render allocates past a worker's memory limit: 1 GB in one call, or a
# 16M-character string more on every iteration of a loop
MEMORY_WORDS = ("center", "width", "percent", "namespace")


def ask(word: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": word}]
