"""placeholder"""

def add_parser(sub):
    return sub.add_parser("prefix")
