//! `AnswerShape`: `kvconductor/answer_shape.py`'s `PyAnswerShape`, compiled.
//! The answer's dicts are made here with interned keys and the owners'
//! names and `DP` keys made once per layout, not once per query.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};

struct Rank {
    slot: usize,
    key: Py<PyString>,
}

struct Instance {
    name: Py<PyString>,
    ranks: Vec<Rank>,
}

/// Per instance, in name order: its name and its (rank, slot)s in rank order.
type Layout<'py> = Vec<(Bound<'py, PyString>, Vec<(i64, usize)>)>;

/// Blocks matched by one owner: GPU, CPU, DISK.
type Lengths = (u64, u64, u64);

#[pyclass(frozen, module = "kvconductor._kernel")]
pub struct AnswerShape {
    instances: Vec<Instance>,
    slots: usize,
}

#[pymethods]
impl AnswerShape {
    #[new]
    fn new(layout: Layout<'_>) -> PyResult<Self> {
        let mut slots = 0;
        let mut instances = Vec::with_capacity(layout.len());
        for (name, ranks) in layout {
            let py = name.py();
            let ranks = ranks
                .into_iter()
                .map(|(rank, slot)| {
                    slots = slots.max(slot + 1);
                    Rank { slot, key: PyString::new(py, &rank.to_string()).unbind() }
                })
                .collect();
            instances.push(Instance { name: name.unbind(), ranks });
        }
        Ok(AnswerShape { instances, slots })
    }

    fn shape<'py>(
        &self,
        py: Python<'py>,
        tenant: &Bound<'py, PyString>,
        lengths: &Bound<'py, PyList>,
        block_size: u64,
        hits_only: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let mut by_slot: Vec<Option<Lengths>> = vec![None; self.slots];
        for item in lengths.iter() {
            let (slot, g, c, d): (usize, u64, u64, u64) = item.extract()?;
            if (d != 0 || !hits_only) && slot < self.slots {
                by_slot[slot] = Some((g, c, d));
            }
        }
        let keys = [
            pyo3::intern!(py, "longest_matched"),
            pyo3::intern!(py, "GPU"),
            pyo3::intern!(py, "CPU"),
            pyo3::intern!(py, "DISK"),
            pyo3::intern!(py, "DP"),
        ];
        let out = PyDict::new(py);
        for inst in &self.instances {
            if inst.ranks.iter().all(|r| by_slot[r.slot].is_none()) {
                continue; // not listed
            }
            let dp = PyDict::new(py);
            let mut best: Option<Lengths> = None;
            for rank in &inst.ranks {
                let Some(m) = by_slot[rank.slot] else { continue };
                dp.set_item(rank.key.bind(py), m.2 * block_size)?;
                // Largest DISK, then GPU, then CPU; ties keep the lower rank.
                if best.is_none_or(|b| (m.2, m.0, m.1) > (b.2, b.0, b.1)) {
                    best = Some(m);
                }
            }
            let Some((g, c, d)) = best else { continue };
            let row = PyDict::new(py);
            row.set_item(keys[0], d * block_size)?;
            row.set_item(keys[1], g * block_size)?;
            row.set_item(keys[2], c * block_size)?;
            row.set_item(keys[3], d * block_size)?;
            row.set_item(keys[4], dp)?;
            out.set_item(inst.name.bind(py), row)?;
        }
        let answer = PyDict::new(py);
        if !out.is_empty() {
            answer.set_item(tenant, out)?;
        }
        Ok(answer)
    }
}
