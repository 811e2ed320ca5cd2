"""netdsl.frontend"""
