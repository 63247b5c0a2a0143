//! The Python edge of `groups`: `GroupState`, the compiled twin of
//! `cache_groups.GroupState`, and `hybrid_hits`, vLLM's hit for every
//! hybrid owner of a query at once (`query._hybrid`).

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use kvconductor_core::groups::{chain, hybrid_hit, Group, Kind, Prefix};

#[pyclass(module = "kvconductor._kernel")]
pub struct GroupState {
    group: Group,
    #[pyo3(get)]
    kind: String,
}

#[pymethods]
impl GroupState {
    /// `lookup`: how the kind is looked up, `cache_groups.lookup_of`:
    /// 0 full attention, 1 window, 2 state, 3 chunked local.
    #[new]
    fn new(kind: String, block_size: usize, window: Option<usize>, lookup: u8) -> PyResult<Self> {
        let how = match lookup {
            0 => Kind::Full,
            1 => Kind::Window,
            2 => Kind::State,
            3 => Kind::Local,
            _ => return Err(pyo3::exceptions::PyValueError::new_err("lookup is 0 to 3")),
        };
        if block_size == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("block_size must be positive"));
        }
        Ok(GroupState { group: Group::new(how, block_size, window), kind })
    }

    #[getter]
    fn block_size(&self) -> usize {
        self.group.block_size
    }

    #[setter]
    fn set_block_size(&mut self, size: usize) -> PyResult<()> {
        if size == 0 {
            return Err(pyo3::exceptions::PyValueError::new_err("block_size must be positive"));
        }
        self.group.block_size = size;
        Ok(())
    }

    #[getter]
    fn window(&self) -> Option<usize> {
        self.group.window
    }

    #[setter]
    fn set_window(&mut self, window: Option<usize>) {
        self.group.window = window;
    }

    fn __len__(&self) -> usize {
        self.group.len()
    }

    fn add(&mut self, seq: u64, key: u64) {
        self.group.add(seq, key);
    }

    fn remove(&mut self, seq: u64) -> bool {
        self.group.remove(seq)
    }

    fn clear(&mut self) -> usize {
        self.group.clear()
    }

    /// (engine hash, key, copies) of every block, by hash.
    fn export(&self) -> Vec<(u64, u64, u32)> {
        self.group.export()
    }
}

/// `cache_groups.hybrid_hit` for each owner of `owners`, a list of (limit,
/// [GroupState]): the prompt is `packed` tokens (its identities computed
/// here from `base`) or, with `packed` None, the identities `idents`; only
/// its first `reach` alignment units are read.
#[pyfunction]
#[pyo3(signature = (packed, idents, base, align, reach, owners))]
pub fn hybrid_hits(
    packed: Option<&Bound<'_, PyBytes>>,
    idents: Vec<u64>,
    base: u64,
    align: usize,
    reach: usize,
    owners: &Bound<'_, PyList>,
) -> PyResult<Vec<usize>> {
    if align == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("align must be positive"));
    }
    let data = packed.map(|p| {
        let bytes = p.as_bytes();
        &bytes[..bytes.len().min(reach.saturating_mul(align * 4))]
    });
    let chained;
    let idents: &[u64] = match data {
        Some(data) => {
            chained = chain(data, align, base);
            &chained
        }
        None => &idents[..idents.len().min(reach)],
    };
    let mut prefix = Prefix::new(data, base, align, idents);
    let mut scratch = Vec::new();
    let mut out = Vec::with_capacity(owners.len());
    for owner in owners.iter() {
        let (limit, groups): (usize, Bound<'_, PyList>) = owner.extract()?;
        let refs = groups
            .iter()
            .map(|g| Ok(g.cast_into::<GroupState>()?.borrow()))
            .collect::<PyResult<Vec<PyRef<'_, GroupState>>>>()?;
        let groups: Vec<&Group> = refs.iter().map(|r| &r.group).collect();
        let limit = limit.min(prefix.units());
        out.push(hybrid_hit(&groups, &mut prefix, limit, &mut scratch));
    }
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<GroupState>()?;
    m.add_function(wrap_pyfunction!(hybrid_hits, m)?)?;
    Ok(())
}
