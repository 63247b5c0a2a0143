//! A small int's value read from the int object itself.
//!
//! `PyLong_AsUnsignedLong` is a call into the interpreter for each token, and
//! a long prompt has thousands: a sizeable share of an in-process query.
//! CPython 3.11 keeps an int as a signed digit count followed by its 30-bit
//! digits, so one in [0, 2**30) (every token id of a real vocabulary) is a
//! count of 0 or 1 and one digit. Later versions changed the layout; there,
//! and for any int this does not recognise, the caller uses the API.

use pyo3::ffi;

#[cfg(all(not(Py_3_12), not(PyPy), not(Py_LIMITED_API)))]
mod layout {
    use std::sync::atomic::{AtomicBool, Ordering};

    use pyo3::ffi;
    use pyo3::prelude::*;

    /// Whether this interpreter's digits are the 30-bit ones read here (a
    /// build may choose 15).
    static DIGITS_30: AtomicBool = AtomicBool::new(false);

    pub fn init(py: Python<'_>) -> PyResult<()> {
        let info = py.import("sys")?.getattr("int_info")?;
        let bits: u32 = info.getattr("bits_per_digit")?.extract()?;
        let size: u32 = info.getattr("sizeof_digit")?.extract()?;
        DIGITS_30.store(bits == 30 && size == 4, Ordering::Relaxed);
        Ok(())
    }

    /// SAFETY: `item` is a live object.
    #[inline]
    pub unsafe fn read(item: *mut ffi::PyObject) -> Option<u32> {
        if !DIGITS_30.load(Ordering::Relaxed) || ffi::Py_TYPE(item) != std::ptr::addr_of_mut!(ffi::PyLong_Type) {
            return None;
        }
        match (*item.cast::<ffi::PyVarObject>()).ob_size {
            0 => Some(0),
            // The first digit follows the header.
            1 => Some(*item.cast::<u8>().add(std::mem::size_of::<ffi::PyVarObject>()).cast::<u32>()),
            _ => None,
        }
    }
}

#[cfg(not(all(not(Py_3_12), not(PyPy), not(Py_LIMITED_API))))]
mod layout {
    use pyo3::ffi;
    use pyo3::prelude::*;

    pub fn init(_: Python<'_>) -> PyResult<()> {
        Ok(())
    }

    #[inline]
    pub unsafe fn read(_: *mut ffi::PyObject) -> Option<u32> {
        None
    }
}

pub use layout::init;

/// `item`'s value when it is an exact int in [0, 2**30) and the layout is
/// known; None otherwise.
///
/// # Safety
/// `item` is a live object.
#[inline]
pub unsafe fn read(item: *mut ffi::PyObject) -> Option<u32> {
    layout::read(item)
}

#[cfg(test)]
mod tests {
    use pyo3::prelude::*;

    /// What `read` makes of `expr`'s value: the digit where the layout is
    /// read here, the API's answer (None) for everything else.
    fn read_of(py: Python<'_>, expr: &str) -> Option<u32> {
        let code = std::ffi::CString::new(expr).unwrap();
        let value = py.eval(&code, None, None).unwrap();
        // SAFETY: `value` is alive for the call.
        unsafe { super::read(value.as_ptr()) }
    }

    #[test]
    fn reads_exact_small_ints_and_nothing_else() {
        Python::initialize();
        Python::attach(|py| {
            super::init(py).unwrap();
            let layout_read = read_of(py, "7").is_some();
            // CPython 3.11 with 30-bit digits (every common build) is read here.
            if cfg!(all(not(Py_3_12), not(PyPy), not(Py_LIMITED_API))) {
                let bits: u32 = py
                    .import("sys")
                    .and_then(|sys| sys.getattr("int_info")?.getattr("bits_per_digit")?.extract())
                    .unwrap();
                assert_eq!(layout_read, bits == 30);
            }
            let small = |v: u32| if layout_read { Some(v) } else { None };
            assert_eq!(read_of(py, "0"), small(0));
            assert_eq!(read_of(py, "7"), small(7));
            assert_eq!(read_of(py, "2**30 - 1"), small((1 << 30) - 1));
            // Two digits, negative, a subclass, not an int: the caller's API path.
            assert_eq!(read_of(py, "2**30"), None);
            assert_eq!(read_of(py, "-1"), None);
            assert_eq!(read_of(py, "True"), None);
            assert_eq!(read_of(py, "1.0"), None);
        });
    }
}
