//! Per-layer format plans: `kvq eval --budget E` picks, for each layer, the cheapest K/V format
//! pair whose attention error stays within `E` ([`choose`]); `--plan-out FILE` writes the choice
//! as JSON and `--plan FILE` reads it back to score it on other data. An engine reads the same
//! file to build each layer's cache in its planned formats ([`Plan::read`], [`Plan::configs`]).
//!
//! The file is one object:
//!
//! ```json
//! {"budget": 0.05, "head_dim": 128, "layers": [{"layer": 0, "k_format": "int4-k32",
//!   "v_format": "fp8-e4m3", "bytes_per_element": 0.78125, "attn_err": 0.031,
//!   "within_budget": true}]}
//! ```
//!
//! `head_dim` is the head size the errors were measured at (absent in older files): a plan
//! made on heads joined by `--pair-heads` does not describe the model's own heads, and
//! [`Plan::configs`] refuses a model of another head_dim. Formats are `KvFormat` names; `bytes_per_element` is the mean of the K and V storage (FP8's
//! per-head scales not counted); `attn_err` the layer's attention-output relative error
//! measured when the plan was made. A layer for which no pair meets the budget gets its most
//! accurate pair, with `within_budget` false (a missing `within_budget` reads as
//! `attn_err <= budget`).

use std::path::Path;

use serde_json::{Value, json};

use crate::error::{Error, Result};
use crate::{CacheConfig, KvFormat};

/// One layer's measured pair, a candidate for the plan.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Key format.
    pub k: KvFormat,
    /// Value format.
    pub v: KvFormat,
    /// Mean of the K and V storage per element.
    pub bytes_per_element: f64,
    /// Attention-output relative error measured for the layer.
    pub attn_err: f64,
}

/// One layer's choice.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Choice {
    /// The layer's index in the model.
    pub layer: usize,
    /// The chosen pair and its measurements.
    pub pair: Candidate,
    /// Whether `attn_err` is within the budget (else this is the most accurate pair).
    pub within_budget: bool,
}

/// A plan: the budget and one choice per layer, in the order chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The attention error the choices were held to.
    pub budget: f64,
    /// The head_dim the errors were measured at; `None` for a file that does not say.
    pub head_dim: Option<usize>,
    /// One choice per layer.
    pub layers: Vec<Choice>,
}

/// Check a budget: finite and not negative ([`Error::InvalidArgument`]).
pub fn check_budget(budget: f64) -> Result<f64> {
    if budget.is_finite() && budget >= 0.0 {
        Ok(budget)
    } else {
        Err(Error::InvalidArgument(format!(
            "budget {budget} must be a finite attention error >= 0"
        )))
    }
}

/// The cheapest of `candidates` whose error is within `budget` (the lower error among equally
/// cheap ones), else the most accurate one; `None` when there are no candidates.
pub fn choose(layer: usize, budget: f64, candidates: &[Candidate]) -> Option<Choice> {
    let by_error = |a: &&Candidate, b: &&Candidate| a.attn_err.total_cmp(&b.attn_err);
    let within = candidates
        .iter()
        .filter(|c| c.attn_err <= budget)
        .min_by(|a, b| {
            a.bytes_per_element
                .total_cmp(&b.bytes_per_element)
                .then_with(|| by_error(a, b))
        });
    let (pair, within_budget) = match within {
        Some(c) => (c, true),
        None => (candidates.iter().min_by(by_error)?, false),
    };
    Some(Choice {
        layer,
        pair: *pair,
        within_budget,
    })
}

impl Choice {
    fn to_json(self) -> Value {
        json!({
            "layer": self.layer,
            "k_format": self.pair.k.name(),
            "v_format": self.pair.v.name(),
            "bytes_per_element": self.pair.bytes_per_element,
            "attn_err": self.pair.attn_err,
            "within_budget": self.within_budget,
        })
    }
}

impl Plan {
    /// The plan as the JSON text of the module docs.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(&self.to_value()).expect("a plan is plain JSON") + "\n"
    }

    /// The plan as a JSON value (to embed in a larger document).
    pub fn to_value(&self) -> Value {
        let mut doc = json!({ "budget": self.budget });
        if let Some(d) = self.head_dim {
            doc["head_dim"] = json!(d);
        }
        doc["layers"] = json!(self.layers.iter().map(|c| c.to_json()).collect::<Vec<_>>());
        doc
    }

    /// Parse a plan; `source` names it in errors ([`Error::InvalidArgument`]: not JSON, a
    /// missing or malformed field, an unknown format, a layer listed twice).
    pub fn from_json(text: &str, source: &str) -> Result<Self> {
        let bad = |what: String| {
            Error::InvalidArgument(
                format!("'{source}' is not a kvq plan: {what}").replace('\n', " "),
            )
        };
        let doc: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
        let number = |v: &Value, what: &str| {
            v.get(what)
                .and_then(Value::as_f64)
                .ok_or_else(|| bad(format!("no number '{what}'")))
        };
        let budget = check_budget(number(&doc, "budget")?).map_err(|e| bad(e.to_string()))?;
        let head_dim = match doc.get("head_dim") {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|d| usize::try_from(d).ok())
                    .filter(|&d| d > 0)
                    .ok_or_else(|| bad(format!("head_dim is {v}, not a positive integer")))?,
            ),
        };
        let entries = doc
            .get("layers")
            .and_then(Value::as_array)
            .ok_or_else(|| bad("no array 'layers'".into()))?;
        let mut layers: Vec<Choice> = Vec::with_capacity(entries.len());
        for entry in entries {
            let layer = entry
                .get("layer")
                .and_then(Value::as_u64)
                .and_then(|l| usize::try_from(l).ok())
                .ok_or_else(|| bad(format!("an entry without a layer index: {entry}")))?;
            if layers.iter().any(|c| c.layer == layer) {
                return Err(bad(format!("layer {layer} appears twice")));
            }
            let format = |what: &str| {
                let name = entry
                    .get(what)
                    .and_then(Value::as_str)
                    .ok_or_else(|| bad(format!("layer {layer} has no '{what}'")))?;
                KvFormat::from_name(name).map_err(|e| bad(format!("layer {layer}: {e}")))
            };
            let pair = Candidate {
                k: format("k_format")?,
                v: format("v_format")?,
                bytes_per_element: number(entry, "bytes_per_element")?,
                attn_err: number(entry, "attn_err")?,
            };
            let within_budget = match entry.get("within_budget") {
                None => pair.attn_err <= budget,
                Some(v) => v
                    .as_bool()
                    .ok_or_else(|| bad(format!("layer {layer}: within_budget is {v}")))?,
            };
            layers.push(Choice {
                layer,
                pair,
                within_budget,
            });
        }
        Ok(Plan {
            budget,
            head_dim,
            layers,
        })
    }

    /// Read a plan file ([`Error::InvalidArgument`] for one that cannot be read or parsed).
    pub fn read(path: &Path) -> Result<Self> {
        let shown = path.display().to_string();
        let bytes = std::fs::read(path)
            .map_err(|e| Error::InvalidArgument(format!("cannot read '{shown}': {e}")))?;
        let text = std::str::from_utf8(&bytes).map_err(|e| {
            Error::InvalidArgument(format!("'{shown}' is not a kvq plan: not UTF-8 ({e})"))
        })?;
        Self::from_json(text, &shown)
    }

    /// Layer `layer`'s choice.
    pub fn layer(&self, layer: usize) -> Option<&Choice> {
        self.layers.iter().find(|c| c.layer == layer)
    }

    /// The (K, V) formats of layers `0..num_layers`, in order: the plan must name each of them
    /// and no other ([`Error::InvalidArgument`]).
    pub fn formats(&self, num_layers: usize) -> Result<Vec<(KvFormat, KvFormat)>> {
        if let Some(c) = self.layers.iter().find(|c| c.layer >= num_layers) {
            return Err(Error::InvalidArgument(format!(
                "the plan names layer {} of a model of {num_layers} layers",
                c.layer
            )));
        }
        (0..num_layers)
            .map(|l| {
                let c = self.layer(l).ok_or_else(|| {
                    Error::InvalidArgument(format!("the plan has no choice for layer {l}"))
                })?;
                Ok((c.pair.k, c.pair.v))
            })
            .collect()
    }

    /// Each layer's cache configuration: `base` (heads, head_dim, block size) with the planned
    /// formats of layers `0..num_layers` ([`formats`](Self::formats)), each validated
    /// ([`CacheConfig::validate`]'s errors: a format that does not take `base`'s head_dim or
    /// block size). A plan measured at another head_dim than `base`'s is
    /// [`Error::InvalidArgument`]: its errors are those of other heads.
    pub fn configs(&self, base: &CacheConfig, num_layers: usize) -> Result<Vec<CacheConfig>> {
        if let Some(d) = self.head_dim.filter(|&d| d != base.head_dim) {
            return Err(Error::InvalidArgument(format!(
                "the plan was measured at head_dim {d} (heads joined by --pair-heads?), the \
                 model's heads are {}",
                base.head_dim
            )));
        }
        self.formats(num_layers)?
            .into_iter()
            .map(|(k, v)| CacheConfig::new(base.num_kv_heads, base.head_dim, base.block_size, k, v))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use KvFormat::*;

    fn c(k: KvFormat, v: KvFormat, attn_err: f64) -> Candidate {
        Candidate {
            k,
            v,
            bytes_per_element: (k.bytes_per_element() + v.bytes_per_element()) / 2.0,
            attn_err,
        }
    }

    #[test]
    fn the_cheapest_pair_within_budget_wins() {
        let all = [
            c(F16, F16, 0.0),
            c(Fp8E4m3, Fp8E4m3, 0.04),
            c(Fp8E5m2, Fp8E5m2, 0.03),
            c(Int4Sym32, Fp8E4m3, 0.06),
            c(Int4Sym32, Int4Affine64, 0.11),
        ];
        let pick = |budget| choose(3, budget, &all).unwrap();
        assert_eq!(pick(0.2).pair, all[4]);
        assert_eq!(pick(0.07).pair, all[3]);
        // Equally cheap: the lower error.
        assert_eq!(pick(0.05).pair, all[2]);
        assert_eq!(pick(0.0).pair, all[0]);
        assert!(pick(0.0).within_budget);
        // Nothing within: the most accurate, flagged.
        let over = choose(3, 0.01, &all[1..]).unwrap();
        assert_eq!((over.pair, over.within_budget), (all[2], false));
        assert_eq!(choose(0, 1.0, &[]), None);
    }

    #[test]
    fn plans_round_trip_and_bad_ones_are_errors() {
        let plan = Plan {
            budget: 0.05,
            head_dim: Some(64),
            layers: vec![
                choose(2, 0.05, &[c(Int4Sym32, Fp8E4m3, 0.031)]).unwrap(),
                choose(0, 0.05, &[c(Bf16, Int4Affine64, 0.07)]).unwrap(),
            ],
        };
        let text = plan.to_json();
        assert_eq!(Plan::from_json(&text, "p").unwrap(), plan);
        assert_eq!(
            plan.layer(0).map(|c| (c.pair.k, c.pair.v)),
            Some((Bf16, Int4Affine64))
        );
        assert!(plan.layer(1).is_none());
        // The minimal form of the issue (no within_budget) reads too.
        let minimal = r#"{"budget":0.1,"layers":[{"layer":1,"k_format":"fp8-e4m3",
            "v_format":"fp8-e4m3","bytes_per_element":1.0,"attn_err":0.04}]}"#;
        let p = Plan::from_json(minimal, "m").unwrap();
        assert!(p.layers[0].within_budget);
        assert_eq!(p.head_dim, None);
        for (bad, mention) in [
            ("[]", "budget"),
            ("not json", "not a kvq plan"),
            (r#"{"budget":-1,"layers":[]}"#, "budget -1"),
            (r#"{"budget":0.1}"#, "layers"),
            (r#"{"budget":0.1,"head_dim":0,"layers":[]}"#, "head_dim"),
            (r#"{"budget":0.1,"head_dim":"64","layers":[]}"#, "head_dim"),
            (
                r#"{"budget":0.1,"layers":[{"k_format":"f16"}]}"#,
                "layer index",
            ),
            (
                r#"{"budget":0.1,"layers":[{"layer":0,"k_format":"int9","v_format":"f16",
                "bytes_per_element":1,"attn_err":0}]}"#,
                "int9",
            ),
            (
                r#"{"budget":0.1,"layers":[{"layer":0,"k_format":"f16","v_format":"f16",
                "bytes_per_element":2,"attn_err":0},{"layer":0,"k_format":"f16",
                "v_format":"f16","bytes_per_element":2,"attn_err":0}]}"#,
                "twice",
            ),
        ] {
            let e = Plan::from_json(bad, "bad.json").unwrap_err().to_string();
            assert!(e.contains(mention) && !e.contains('\n'), "{bad}: {e}");
        }
    }

    #[test]
    fn a_plan_gives_every_layer_its_config() {
        let mut plan = Plan {
            budget: 0.05,
            head_dim: None,
            layers: vec![
                choose(1, 0.05, &[c(Int4Sym32, Fp8E4m3, 0.031)]).unwrap(),
                choose(0, 0.05, &[c(Bf16, Int4Affine64, 0.07)]).unwrap(),
            ],
        };
        let base = CacheConfig::new(8, 128, 16, F16, F16).unwrap();
        let configs = plan.configs(&base, 2).unwrap();
        assert_eq!(
            configs
                .iter()
                .map(|c| (c.k_format, c.v_format))
                .collect::<Vec<_>>(),
            [(Bf16, Int4Affine64), (Int4Sym32, Fp8E4m3)]
        );
        assert!(
            configs
                .iter()
                .all(|c| c.head_dim == 128 && c.block_size == 16)
        );
        assert!(matches!(plan.formats(3), Err(Error::InvalidArgument(m)) if m.contains("layer 2")));
        assert!(matches!(plan.formats(1), Err(Error::InvalidArgument(m)) if m.contains("layer 1")));
        // A planned format that does not take the model's head_dim is the layout's error.
        let d48 = CacheConfig::new(8, 48, 16, F16, F16).unwrap();
        assert!(plan.configs(&d48, 2).is_err());
        // A plan measured on other heads (joined ones) is refused, one of these heads is not.
        plan.head_dim = Some(256);
        let e = plan.configs(&base, 2).unwrap_err().to_string();
        assert!(e.contains("head_dim 256"), "{e}");
        plan.head_dim = Some(128);
        assert_eq!(plan.configs(&base, 2).unwrap(), configs);
    }
}
