//! `AnswerShape`: `kvconductor/index/answer_shape.py`'s `PyAnswerShape`, compiled.
//! The layout and the JSON answer are `kvconductor_core::answer::Shape`'s;
//! here the answer is made as dicts with interned keys, with the owners'
//! names and `DP` keys made once per layout, not once per query.

use kvconductor_core::answer::{Lengths, Shape};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

/// Per instance, in name order: its name, the name as JSON, and its
/// (rank, slot)s in rank order.
type Layout<'py> = Vec<(Bound<'py, PyString>, Vec<u8>, Vec<(i64, usize)>)>;

#[pyclass(module = "kvconductor._kernel")]
pub struct AnswerShape {
    tenant: Py<PyString>,
    /// Instances named and ranks keyed by interned Python strings.
    shape: Shape<Py<PyString>, Py<PyString>>,
}

/// The (slot, GPU, CPU, DISK) lengths a walk gave, those with DISK 0 left
/// out when `hits_only`.
fn read_lengths(lengths: &Bound<'_, PyList>, hits_only: bool) -> PyResult<Vec<(usize, Lengths)>> {
    let mut listed = Vec::with_capacity(lengths.len());
    for item in lengths.iter() {
        let (slot, g, c, d): (usize, u64, u64, u64) = item.extract()?;
        if d != 0 || !hits_only {
            listed.push((slot, (g, c, d)));
        }
    }
    Ok(listed)
}

#[pymethods]
impl AnswerShape {
    #[new]
    fn new(tenant: Bound<'_, PyString>, tenant_json: Vec<u8>, block_size: u64, layout: Layout<'_>) -> PyResult<Self> {
        let mut shape = AnswerShape { tenant: tenant.unbind(), shape: Shape::new(tenant_json, block_size) };
        for (name, name_json, ranks) in layout {
            shape.set_instance(name, name_json, ranks)?;
        }
        Ok(shape)
    }

    /// One instance's (rank, slot)s, in rank order, in place of what it
    /// had (none: the instance goes). A change of owners costs this and,
    /// at the next answer, a pass over the owners' slots in Rust, where
    /// making the whole shape again in Python cost ~40 ms at 10,000 owners.
    fn set_instance(
        &mut self,
        name: Bound<'_, PyString>,
        name_json: Vec<u8>,
        ranks: Vec<(i64, usize)>,
    ) -> PyResult<()> {
        let py = name.py();
        let order: Vec<u8> = name.call_method1("encode", ("utf-32-be", "surrogatepass"))?.extract()?;
        let key = |rank: i64| PyString::new(py, &rank.to_string()).unbind();
        self.shape.set_instance(order, name.unbind(), name_json, ranks, key);
        Ok(())
    }

    fn shape<'py>(
        &mut self,
        py: Python<'py>,
        lengths: &Bound<'py, PyList>,
        hits_only: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let listed = read_lengths(lengths, hits_only)?;
        let bs = self.shape.block_size();
        let keys = [
            pyo3::intern!(py, "longest_matched"),
            pyo3::intern!(py, "GPU"),
            pyo3::intern!(py, "CPU"),
            pyo3::intern!(py, "DISK"),
            pyo3::intern!(py, "DP"),
        ];
        let out = PyDict::new(py);
        self.shape.rows(listed, |name, (g, c, d), ranks| {
            // One int object wherever the row repeats a number (DISK is
            // longest_matched, and GPU or CPU often equal it): at a hundred
            // instances the answer's allocations are most of its cost.
            let disk = (d * bs).into_pyobject(py)?;
            let same = |n: u64| if n == d { Ok(disk.clone()) } else { (n * bs).into_pyobject(py) };
            let dp = PyDict::new(py);
            for (key, m) in ranks {
                dp.set_item(key.bind(py), same(m.2)?)?;
            }
            let row = PyDict::new(py);
            row.set_item(keys[0], &disk)?;
            row.set_item(keys[1], same(g)?)?;
            row.set_item(keys[2], same(c)?)?;
            row.set_item(keys[3], &disk)?;
            row.set_item(keys[4], dp)?;
            out.set_item(name.bind(py), row)
        })?;
        let answer = PyDict::new(py);
        if !out.is_empty() {
            answer.set_item(self.tenant.bind(py), out)?;
        }
        Ok(answer)
    }

    /// `shape`'s answer (with every listed owner) as the JSON msgspec
    /// writes for it.
    fn shape_json<'py>(&mut self, py: Python<'py>, lengths: &Bound<'py, PyList>) -> PyResult<Bound<'py, PyBytes>> {
        let rows = lengths.len();
        let listed = read_lengths(lengths, false)?;
        Ok(PyBytes::new(py, &self.shape.json(listed, rows)))
    }
}

impl AnswerShape {
    /// `shape_json`'s answer for lengths a walk left in Rust (no tuple an
    /// owner: at 10,000 owners making and reading them was most of an
    /// answer that lists them all).
    pub(crate) fn json_of<'py>(
        &mut self,
        py: Python<'py>,
        listed: Vec<(usize, Lengths)>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let rows = listed.len();
        Ok(PyBytes::new(py, &self.shape.json(listed, rows)))
    }
}
