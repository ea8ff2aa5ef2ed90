#!/usr/bin/env python3
"""Lists function definitions longer than N lines (default 120) in product code
(services/, common/ by default): brace matching over the source with strings,
characters and comments removed; a block opened outside any function whose
header has ( and is not a namespace/class/struct/enum is a function.

    /usr/bin/python3 scripts/tools/long_functions.py [N] [paths...]
"""
import re, subprocess, sys
limit = int(sys.argv[1]) if len(sys.argv) > 1 else 120
paths = sys.argv[2:] or ['services', 'common']
files = subprocess.check_output(['git', 'ls-files', *[p + '/*.cc' for p in paths], *[p + '/*.h' for p in paths]]).decode().split()
def strip(src):
    src = re.sub(r'R"(\w*)\((.|\n)*?\)\1"', '""', src)
    src = re.sub(r'//[^\n]*', '', src)
    src = re.sub(r'/\*(.|\n)*?\*/', lambda m: '\n' * m.group(0).count('\n'), src)
    src = re.sub(r'"(\\.|[^"\\\n])*"', '""', src)
    src = re.sub(r"'(\\.|[^'\\\n])*'", "''", src)
    return src
found = 0
for f in files:
    src = strip(open(f, encoding='utf-8').read())
    stack = []  # (kind, start_line)
    header = ''
    line = 1
    for ch in src:
        if ch == '\n':
            line += 1
            header += ' '
        elif ch == '{':
            h = header.strip()
            in_func = any(k == 'f' for k, _ in stack)
            is_func = (not in_func and '(' in h and not re.search(r'\b(namespace|class|struct|enum|union)\b[^(]*$', h)
                       and not h.endswith('=') and not re.search(r'=\s*$', h))
            stack.append(('f' if is_func else 'b', line))
            header = ''
        elif ch == '}':
            if stack:
                k, s = stack.pop()
                if k == 'f' and line - s + 1 > limit:
                    print(f'{line - s + 1:5d} {f}:{s}')
                    found += 1
            header = ''
        elif ch == ';':
            header = ''
        else:
            header += ch
sys.exit(1 if found else 0)
