"""Context-preserving negative captions and contextual word features (InfoGround, Sec. 2.4-2.5)."""
