#![cfg(feature = "cli")]
