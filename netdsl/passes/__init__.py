"""netdsl.passes"""
